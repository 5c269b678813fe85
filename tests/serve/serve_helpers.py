"""Helpers: a `spanllm serve` front end on the tiny preset (float32, CPU) in a background thread, on a free port."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time

import httpx
import torch

from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.serve.server import Server

NUM_KV_BLOCKS = 256


def make_llm(**engine) -> LLM:
    llm = LLM(
        "tiny",
        EngineConfig(dtype=torch.float32, seed=0, num_kv_blocks=engine.pop("num_kv_blocks", NUM_KV_BLOCKS), **engine),
        device=torch.device("cpu"),
    )
    llm.get_tokenizer()
    return llm


def start_cli_server(
    serve_args: list[str], deadline: float, what: str = "the server", env: dict | None = None
) -> tuple[subprocess.Popen, str]:
    """`spanllm serve SERVE_ARGS` (with --port 0) as a subprocess; returns (the process, its base URL) once it
    prints the address it bound, by `deadline` (time.monotonic()). Kills it if it never comes up."""
    cmd = [sys.executable, "-m", "spanllm.cli", "serve", *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        base, seen = None, []
        while base is None:
            assert time.monotonic() < deadline, f"{what} did not come up:\n" + "".join(seen)
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, f"{what} exited:\n" + "".join(seen)
                continue
            seen.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+) ", line)
            base = m.group(1) if m else None
        return proc, base
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def sigterm_and_check(proc: subprocess.Popen, descendants: list[int], what: str, outlived: str) -> None:
    """SIGTERM the server: it must exit within 20 s, and `descendants` (its ranks or its front-end process) within
    5 s more (bounds that turn a hang into a failure, not speed checks)."""
    import signal

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what} did not stop within 20 s of SIGTERM") from None
    deadline = time.monotonic() + 5
    while any(alive(p) for p in descendants) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in descendants), outlived


def descendants(pid: int) -> list[int]:
    """Every process below pid (children, their children, ...)."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def children(pid: int) -> list[int]:
    """Process ids whose parent is pid (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def alive(pid: int) -> bool:
    """pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def metrics_of(base_url: str) -> dict[str, float]:
    """name{labels} -> value, for the spanllm: samples of base_url's /metrics (buckets and _created left out)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("spanllm:") and "_bucket" not in line and "_created" not in line:
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def metric_of(base_url: str, name: str, **labels) -> float:
    """The sum of name's samples with these labels."""
    return sum(
        v
        for k, v in metrics_of(base_url).items()
        if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items())
    )


class Running:
    def __init__(self, server: Server, thread: threading.Thread) -> None:
        self.server, self.thread = server, thread
        self.base_url = f"http://127.0.0.1:{server.port}"

    def metrics(self) -> dict[str, float]:
        return metrics_of(self.base_url)

    def metric(self, name: str, **labels) -> float:
        return metric_of(self.base_url, name, **labels)


def start_server(llm: LLM, **kw) -> Running:
    server = Server(llm, host="127.0.0.1", port=0, **kw)
    errors = []

    def target():
        try:
            server.run()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=target, name="spanllm-test-server", daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if errors or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start: {errors}")
        time.sleep(0.02)
    return Running(server, t)


def stop_server(r: Running) -> None:
    r.server.stop()
    r.thread.join(15)
    assert not r.thread.is_alive(), "the server thread did not stop"


def offline_greedy(ctx, prompts: list[str], max_tokens: int):
    """LLM.generate on every rank of a launch() job (TP = world size); rank 0's texts."""
    from spanllm.engine.sampler import SamplingParams
    from spanllm.model.parallel_dims import ParallelDims

    llm = LLM(
        "tiny",
        EngineConfig(dtype=torch.float32, seed=0, num_kv_blocks=NUM_KV_BLOCKS),
        dims=ParallelDims(ctx.world_size, 1, ctx.world_size),
        device=torch.device("cpu"),
    )
    llm.get_tokenizer()
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        return [o.text for o in outs] if ctx.rank == 0 else None
    finally:
        llm.close()
