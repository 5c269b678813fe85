"""Local gloo launches when something goes wrong: the first real error wins, a stopped rank is named, workers
die with their parent and the temporary folder goes on every exit path."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from spanllm.errors import RankError
from spanllm.launch import _first_error, error_kind, launch

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


# --- workers (module level: spawned ranks import them) ------------------------------------------------------
def raise_on(ctx, bad_rank: int) -> int:
    """`bad_rank` raises at once; the others sit in an all-reduce until its sockets close."""
    if ctx.rank == bad_rank:
        raise ValueError(f"token id 9999 at position 3 is outside the vocabulary (rank {ctx.rank})")
    dist.all_reduce(torch.ones(4))
    return ctx.rank


def stop_rank1(ctx, how: str) -> int:
    """Rank 1 stops answering (SIGSTOP, or a long sleep); rank 0 waits for it in a barrier."""
    if ctx.rank == 1:
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
    dist.barrier()
    return ctx.rank


def sleep_forever(ctx, piddir: str) -> None:
    with open(os.path.join(piddir, f"{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


# --- the first real error wins ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_rank", [1, 1, 0])
def test_first_real_error_wins(bad_rank):
    with pytest.raises(RankError) as e:
        launch(raise_on, bad_rank, nprocs=2, timeout_s=30)
    err = e.value
    assert err.rank == bad_rank and err.type_name == "ValueError"
    assert (
        str(err) == f"rank {bad_rank} raised ValueError: token id 9999 at position 3 is outside the vocabulary "
        f"(rank {bad_rank})"
    )
    assert "Connection closed" not in str(err) and "raise ValueError" in err.traceback
    assert err.exit_code == 1 and not err.known  # not a project error: the CLI shows its traceback


def test_stopped_rank_is_named():
    """launch's own timeout_s (5 s) is what ends the wait for the stopped rank: the message names it."""
    with pytest.raises(RankError) as e:
        launch(stop_rank1, "stop", nprocs=2, timeout_s=5)
    msg = str(e.value)
    assert msg.startswith("rank 1 (stopped) stopped answering: rank 0 timed out after 5 s"), msg
    assert "--pg-timeout" in msg and "SPANLLM_PG_TIMEOUT_S" in msg


# --- which error is reported: a pure function of the records ----------------------------------------------
def _rec(rank, t, kind, type_="RuntimeError", message="m", code=None):
    return {
        "rank": rank,
        "time": t,
        "type": type_,
        "module": "builtins",
        "message": message,
        "traceback": "tb",
        "kind": kind,
        "exit_code": code,
    }


def _first(tmp_path, records, exits=None, running=None):
    import json

    for r in records:
        (tmp_path / f"error{r['rank']}.json").write_text(json.dumps(r))
    return _first_error(str(tmp_path), 4, exits or {}, running or {}, 5.0)


def test_error_kinds():
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:29595")
    assert error_kind(closed) == "peer"
    assert error_kind(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 2000ms for recv")) == "timeout"
    assert error_kind(ValueError("--timeout-s 0: must be > 0")) == "error"  # a project error mentioning timeouts
    assert error_kind(KeyboardInterrupt()) == "interrupt"


def test_own_error_beats_an_earlier_connection_error(tmp_path):
    err = _first(
        tmp_path,
        [
            _rec(0, 1.0, "peer", message="Connection closed by peer"),
            _rec(2, 2.0, "error", "ModelConfigError", "bad config", 2),
            _rec(3, 1.5, "error", "IndexError", "late"),
        ],
    )
    assert (err.rank, err.exit_code, err.known) == (3, 1, False)
    err = _first(tmp_path, [_rec(3, 9.0, "error", "IndexError", "late")])
    assert (err.rank, str(err), err.exit_code, err.known) == (2, "rank 2: bad config", 2, True)


def test_a_signal_death_beats_its_peers_connection_errors(tmp_path):
    err = _first(tmp_path, [_rec(0, 1.0, "peer")], exits={0: (1, 2.0), 1: (-9, 1.5)})
    assert err.rank == 1 and str(err) == "rank 1 was killed by SIGKILL"


def test_timeout_names_the_ranks_still_running(tmp_path):
    err = _first(
        tmp_path,
        [_rec(0, 1.0, "timeout"), _rec(2, 1.1, "timeout")],
        exits={0: (1, 1), 2: (1, 1)},
        running={1: "sleeping", 3: "stopped"},
    )
    assert str(err).startswith(
        "rank 1 (sleeping), rank 3 (stopped) stopped answering: ranks 0, 2 timed out after 5 s waiting in a collective"
    )
    # the message says it all: a known error (the CLI shows the rank's traceback only with --debug), exit code 1
    assert (err.known, err.exit_code, err.traceback) == (True, 1, "tb")


def test_a_timeout_alone_is_a_known_error(tmp_path):
    err = _first(tmp_path, [_rec(1, 1.0, "timeout", message="Timed out waiting 1ms for send")], exits={1: (1, 1)})
    assert str(err).startswith("ranks 1 timed out after 5 s in a collective (Timed out waiting 1ms for send)")
    assert (err.rank, err.known, err.exit_code) == (1, True, 1)


# --- workers die with the parent; the folder goes ----------------------------------------------------------
def _start_parent(tmp_path):
    piddir, tmpdir = tmp_path / "pids", tmp_path / "tmp"
    piddir.mkdir()
    tmpdir.mkdir()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        from spanllm.errors import Interrupted
        from spanllm.launch import launch
        from test_launch import sleep_forever
        try:
            launch(sleep_forever, {str(piddir)!r}, nprocs=2)
        except Interrupted as e:
            sys.exit(e.exit_code)
    """)
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": REPO}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 60

    def complete_pids() -> list[int]:  # a file may exist before its write lands: count only whole numbers
        out = []
        for f in piddir.glob("*.pid"):
            text = f.read_text().strip()
            if text.isdigit():
                out.append(int(text))
        return out

    while len(complete_pids()) < 2:
        if parent.poll() is not None or time.monotonic() >= deadline:
            parent.kill()
            raise AssertionError(
                "the launching process ended early"
                if parent.poll() is not None
                else "the ranks did not start within 60 s"
            )
        time.sleep(0.1)
    return parent, complete_pids(), tmpdir


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_all(parent, pids) -> None:
    """Whatever a failed assertion left running is killed, so no rank outlives the test."""
    if parent.poll() is None:
        parent.kill()
        parent.wait()
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _wait_dead(pids, seconds=10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_parent_stops_workers_and_removes_folder(tmp_path):
    parent, pids, tmpdir = _start_parent(tmp_path)
    try:
        parent.send_signal(signal.SIGTERM)  # what `timeout` sends; SIGINT takes the same path
        assert parent.wait(timeout=30) == 128 + signal.SIGTERM
        assert _wait_dead(pids) == []
        assert glob.glob(str(tmpdir / "spanllm-launch-*")) == []
    finally:
        _kill_all(parent, pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_sigkill_of_parent_kills_workers(tmp_path):
    parent, pids, _ = _start_parent(tmp_path)
    try:
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_dead(pids) == []  # the folder stays: nothing runs after a SIGKILL
    finally:
        _kill_all(parent, pids)
