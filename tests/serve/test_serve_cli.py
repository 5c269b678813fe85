"""`spanllm serve`: every number flag outside its range stops with one line naming the flag and the range
(exit 2), before any engine is built."""

from __future__ import annotations

import pytest

from spanllm.cli import main

BAD = [
    ("--port", "70000", "[0, 65535]"),
    ("--port", "-1", "[0, 65535]"),
    ("--seed", str(2**64), "[-9223372036854775808, 9223372036854775807]"),
    ("--nprocs", "0", ">= 1"),
    ("--ranks-per-node", "0", "must be a positive integer"),
    ("--max-model-len", "0", ">= 2"),
    ("--max-num-seqs", "0", ">= 1"),
    ("--max-num-batched-tokens", "0", ">= 1"),
    ("--block-size", "0", ">= 1"),
    ("--gpu-memory-utilization", "1.5", "(0, 1]"),
    ("--gpu-memory-utilization", "nan", "(0, 1]"),
    ("--num-kv-blocks", "1", ">= 2"),
    ("--min-admit", "0", ">= 1"),
    ("--min-admit", "1000", "more than --max-num-seqs 256 slots can never be free at once"),
    ("--tp", "0", ">= 1"),
    ("--max-queued-requests", "0", ">= 1"),
    ("--max-body-bytes", "0", ">= 1"),
    ("--header-timeout", "0", "(0, 3600]"),
    ("--body-timeout", "-1", "(0, 3600]"),
    ("--keep-alive-timeout", "nan", "(0, 3600]"),
    ("--max-connections", "0", ">= 1"),
    ("--max-stop-strings", "-1", ">= 0"),
    ("--max-stop-string-length", "0", ">= 1"),
]


@pytest.mark.parametrize("flag,value,words", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_bad_number(flag, value, words, capsys):
    assert main(["serve", "--model", "tiny", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"spanllm: error: {flag} ") and words in err[0], err


def test_port_in_use_is_one_line_before_the_engine(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--model", "tiny", "--port", str(port)]) == 2
    err = capsys.readouterr()
    assert f"spanllm: error: --port {port}: 127.0.0.1:{port} is already in use" in err.err
    assert "building the engine" not in err.out + err.err


@pytest.mark.parametrize("port", ["0", "18700"])
def test_unresolvable_host_is_one_line_whatever_the_port(port, capsys):
    """--port 0 (any free port) checks the host too: before, the front end failed after the engine was built."""
    assert main(["serve", "--model", "tiny", "--host", "999.1.1.1", "--port", port]) == 2
    err = capsys.readouterr()
    assert err.err.strip() == (
        "spanllm: error: --host '999.1.1.1': cannot resolve it (Name or service not known); give an address, e.g. "
        "127.0.0.1"
    )
    assert "building the engine" not in err.out + err.err


def test_log_level_is_one_of_uvicorns(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "tiny", "--log-level", "bogus"])
    assert e.value.code == 2
    assert "argument --log-level: invalid choice: 'bogus'" in capsys.readouterr().err
