"""--max-queued-requests under a burst: what counts as waiting is decided when a request is accepted, by the KV
blocks and sequence slots its prompt needs (spanllm.serve.async_engine.QueueLedger), not by the engine's last
report, which does not know the requests still on their way to it. A burst into a pool that holds 3 of its
prompts, bound 8: exactly 3 + 8 accepted, the rest 503, every accepted one served, and /metrics never shows more
than 8 waiting. Both front-end modes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from serve_helpers import make_llm, metric_of, start_server, stop_server

from spanllm.engine.sampler import SamplingParams
from spanllm.serve.async_engine import Delta, FrontDoor, QueueFull, QueueLedger

FULL = "the waiting queue is full (8 requests, --max-queued-requests); retry later"


def test_ledger_counts_what_the_pool_holds():
    """48 blocks of 16 tokens (block 0 reserved: 47 usable). A 190-token prompt and its first token take
    ceil(191 / 16) = 12 blocks: 3 of them hold 36 and a 4th would need 48 > 47, so of 24 at once 3 run, 21 wait."""
    led = QueueLedger(47, 16, 256)
    assert [led.add(f"r{i}", 190) for i in range(24)] == [True] * 3 + [False] * 21
    assert (list(led.running), led.num_waiting, led.free_blocks) == (["r0", "r1", "r2"], 21, 11)
    led.remove("r1")  # one ends: the oldest waiting one takes its 12 blocks
    assert (list(led.running), led.num_waiting, led.free_blocks) == (["r0", "r2", "r3"], 20, 11)
    led.remove("r9")  # a waiting one leaves (its client went away): it held nothing
    assert (led.num_waiting, led.free_blocks) == (19, 11)
    led.remove("r9")  # unknown (ended already): nothing changes
    assert (led.num_waiting, led.free_blocks) == (19, 11)


def test_ledger_is_first_come_first_served_and_counts_slots():
    """A short prompt behind a waiting long one waits too (the engine admits in arrival order); when the long one
    gets room, the short ones behind it that fit come along. Slots: max_num_seqs 2 runs 2 even with blocks free."""
    led = QueueLedger(10, 16, 256)
    assert led.add("big", 16 * 8 - 1) and led.free_blocks == 2  # 128 positions: 8 blocks
    assert not led.add("big2", 16 * 8 - 1)  # 8 blocks > 2 free: waits
    assert not led.add("small", 1)  # 1 block would fit, but big2 is ahead of it
    led.remove("big")  # 10 free: big2 (8) runs, then small (1), 1 block left
    assert (list(led.running), led.num_waiting, led.free_blocks) == (["big2", "small"], 0, 1)
    slots = QueueLedger(100, 16, 2)
    assert [slots.add(f"r{i}", 1) for i in range(4)] == [True, True, False, False]
    slots.remove("r0")
    assert (list(slots.running), list(slots.waiting)) == (["r1", "r2"], ["r3"])


class _Door(FrontDoor):
    """The front door's admission alone: the engine's report is `engine` (waiting after its last step, requests
    on their way to it)."""

    alive = True
    vocab_size = 512
    capacity_tokens = 47 * 16
    max_model_len = 512
    has_tokenizer = True
    eos_token_ids = ()

    def __init__(self, bound: int) -> None:
        super().__init__(bound)
        self._ledger = QueueLedger(47, 16, 256)
        self.engine = (0, 0)
        self.sent = 0

    def _engine_counts(self) -> tuple[int, int]:
        return self.engine[0], self.engine[1] + self.sent

    def _count_add(self) -> None:
        self.sent += 1


def _burst(door: _Door, names: list[str]) -> list[str]:
    """Offer each request (190 prompt tokens, 4 to generate); the ones accepted."""

    async def go():
        accepted = []
        for rid in names:
            try:
                door._open_stream(rid, [5] * 190, SamplingParams(max_tokens=4))
            except QueueFull as e:
                assert str(e) == FULL
            else:
                accepted.append(rid)
        return accepted

    return asyncio.run(go())


def test_burst_into_a_pool_of_three_accepts_three_plus_the_bound():
    """The audit's burst: 24 at once, none seen by the engine yet (its last report: nothing waiting, nothing on its
    way), pool of 47 blocks, bound 8. The first 3 fit the pool (above), the next 8 wait: 11 accepted, 13 refused.
    The slot-only estimate counted all 24 as heading to one of the 256 free slots, and accepted them all."""
    door = _Door(8)
    assert _burst(door, [f"r{i}" for i in range(24)]) == [f"r{i}" for i in range(11)]
    assert door.num_waiting() == 8
    # r0 ends: r3 moves up to run, one place is free in the queue, and the next one takes it
    door._deliver([("r0", Delta("", [], 4, True, "length", None, ""))])
    assert door.num_waiting() == 7
    assert _burst(door, ["late0", "late1"]) == ["late0"]
    # the client of a waiting request leaves: its place is free
    door._close_stream("r5")
    assert door.num_waiting() == 7
    # the engine reports more waiting than the ledger counts (it preempted a running request): 9 after its step,
    # every accepted request received; refused until it reports fewer
    door.engine, door.sent = (9, 0), 0
    assert door.num_waiting() == 9 and _burst(door, ["late2"]) == []
    door.engine = (6, 0)
    assert door.num_waiting() == 7 and _burst(door, ["late3", "late4"]) == ["late3"]


def _process_server(llm, bound: int):
    """A ProcessServer (the default `spanllm serve`: the front end in a process of its own) in a thread; returns
    (its base URL, stop)."""
    from spanllm.serve.frontend_process import ProcessServer

    server = ProcessServer(llm, host="127.0.0.1", port=0, model_name="tiny", max_queued_requests=bound)
    errors: list = []

    def target():
        try:
            server.run()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=target, name="spanllm-test-process-server", daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while not server.engine.started.is_set():
        if errors or not t.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start: {errors}")
        time.sleep(0.05)

    def stop():
        server.stop()
        t.join(30)
        assert not t.is_alive(), "the server thread did not stop"
        assert not errors, errors

    return f"http://127.0.0.1:{server.port}", stop


@pytest.mark.parametrize("frontend_process", [False, True], ids=["one-process", "frontend-process"])
def test_burst_is_bounded_and_every_accepted_request_is_served(frontend_process):
    """50 KV blocks (49 usable), bound 8, 24 streamed requests at once with distinct 200-token prompts (no prefix
    shared) and max_tokens 50. A prompt and its first token take ceil(201 / 16) = 13 blocks: 3 fit (39), a 4th
    would need 52 > 49; so 3 + 8 = 11 are accepted and 13 get the 503. The engine's step is held until every
    answer's status is in (a step as slow as the real model's prefill on a CPU: the whole burst arrives within it),
    so no request ends during the burst and the count is exact. Then each accepted one runs its 50 tokens (3 x 250
    tokens = 48 blocks: the 3 oldest never get preempted), and /metrics never shows more than 8 waiting."""
    llm = make_llm(num_kv_blocks=50)
    core = llm.engine_core
    gate = threading.Event()
    step = core.step

    def held_step():
        gate.wait(120)
        return step()

    core.step = held_step
    if frontend_process:
        base, stop = _process_server(llm, 8)
    else:
        r = start_server(llm, model_name="tiny", max_queued_requests=8)
        base, stop = r.base_url, lambda: stop_server(r)
    try:
        statuses: list[int] = []
        all_in = asyncio.Event()
        waiting_seen: list[float] = []

        async def one(h: httpx.AsyncClient, i: int):
            body = {
                "prompt": f"{i:02d}" + "x" * 197,
                "max_tokens": 50,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with h.stream("POST", "/v1/completions", json=body) as resp:
                statuses.append(resp.status_code)
                if len(statuses) == 24:
                    all_in.set()
                return resp.status_code, (await resp.aread()).decode()

        async def watch(h: httpx.AsyncClient, done: asyncio.Event):
            while not done.is_set():
                text = (await h.get("/metrics")).text
                line = next(x for x in text.splitlines() if x.startswith("spanllm:num_requests_waiting{"))
                waiting_seen.append(float(line.rsplit(" ", 1)[1]))
                await asyncio.sleep(0.005)

        async def go():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as h:
                tasks = [asyncio.create_task(one(h, i)) for i in range(24)]
                await asyncio.wait_for(all_in.wait(), 60)
                done = asyncio.Event()
                watcher = asyncio.create_task(watch(h, done))
                gate.set()
                out = await asyncio.gather(*tasks)
                done.set()
                await watcher
                return out

        out = asyncio.run(go())
        codes = [c for c, _ in out]
        assert sorted(codes) == [200] * 11 + [503] * 13, codes
        for code, text in out:
            if code == 503:
                assert FULL in text, text
                continue
            chunks = [x[5:].strip() for x in text.splitlines() if x.startswith("data:")]
            assert chunks[-1] == "[DONE]", chunks[-3:]
            last, usage = json.loads(chunks[-3]), json.loads(chunks[-2])["usage"]
            assert last["choices"][0]["finish_reason"] == "length", last
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (200, 50), usage
        assert metric_of(base, "spanllm:request_success_total", finished_reason="length") == 11
        assert metric_of(base, "spanllm:generation_tokens_total") == 11 * 50
        assert waiting_seen and max(waiting_seen) <= 8, waiting_seen
        assert metric_of(base, "spanllm:num_requests_waiting") == 0
        # the queue is empty again: a request is served
        ok = httpx.post(base + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        gate.set()
        stop()
        core.step = step
        llm.close()
