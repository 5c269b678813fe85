"""Multi-turn ShareGPT (spanllm.bench.multi_turn) against the fake OpenAI server: which conversations and turns are
replayed, every turn's prompt is the conversation so far with the server's own earlier answers, turns of different
conversations interleave, a conversation stops before passing the context limit, TTFT is reported per turn, and a
server without prefix-cache counters gives no hit rate but a note saying why. Then the /metrics counters: parsed
from a page the server's own ServerMetrics renders, and the hit rate of a run from two readings."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("aiohttp", reason="the multi-turn client needs aiohttp")

from fake_openai_server import FakeServer  # noqa: E402

from spanllm.bench.multi_turn import (  # noqa: E402
    MultiTurnConfig,
    render,
    run_conversations,
    sample_conversations,
    save_conversations,
)
from spanllm.bench.prefix_cache_metrics import parse_prefix_cache_counters, prefix_cache_result  # noqa: E402
from spanllm.errors import UsageError  # noqa: E402


class WordTokenizer:
    """BOS + one token per whitespace-separated word."""

    def encode(self, text: str) -> list[int]:
        return [0] + [1] * len(text.split())


def _conv(i: int, turns: int, reply_words: int = 5) -> dict:
    msgs = []
    for t in range(turns):
        msgs += [{"from": "human", "value": f"c{i} t{t} q"}, {"from": "gpt", "value": " ".join(["a"] * reply_words)}]
    return {"id": f"c{i}", "conversations": msgs}


@pytest.fixture
def sharegpt(tmp_path):
    records = [_conv(0, 1), _conv(1, 3), _conv(2, 2, reply_words=2), _conv(3, 5), _conv(4, 4, reply_words=400)]
    records.append({"id": "bad", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]})
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records))
    return str(path)


def test_sample_conversations(sharegpt):
    convs, info = sample_conversations(WordTokenizer(), 4, max_turns=4, min_turns=2, seed=0, dataset=sharegpt)
    by_id = {c.id: c for c in convs}
    assert set(by_id) == {"c1", "c2", "c3", "c4"}  # c0 has one human turn, "bad" starts with gpt
    assert by_id["c1"].user_turns == ("c1 t0 q", "c1 t1 q", "c1 t2 q") and by_id["c1"].output_lens == (5, 5, 5)
    assert by_id["c2"].output_lens == (4, 4)  # 2-word answers: at least 4 tokens
    assert len(by_id["c3"].user_turns) == 4 and by_id["c4"].output_lens == (256,) * 4  # capped turns and lengths
    assert info["turns"] == 3 + 2 + 4 + 4
    fixed, _ = sample_conversations(WordTokenizer(), 2, seed=0, dataset=sharegpt, output_len=3)
    assert all(set(c.output_lens) == {3} for c in fixed)
    with pytest.raises(UsageError, match="only 4 conversations"):
        sample_conversations(WordTokenizer(), 5, dataset=sharegpt)


def test_saved_conversations_sample_the_same(sharegpt, tmp_path):
    convs, _ = sample_conversations(WordTokenizer(), 3, max_turns=3, seed=4, dataset=sharegpt)
    path = str(tmp_path / "saved.json")
    save_conversations(convs, path)
    again, info = sample_conversations(WordTokenizer(), 3, max_turns=3, seed=9, dataset=path)
    assert sorted(again, key=lambda c: c.id) == sorted(convs, key=lambda c: c.id) and info["turns"] == 8


def test_replay_resends_the_conversation_with_the_servers_answers(sharegpt):
    convs, _ = sample_conversations(WordTokenizer(), 3, max_turns=3, seed=1, dataset=sharegpt, output_len=3)
    with FakeServer() as server:
        cfg = MultiTurnConfig(base_url=server.url, model="fake-model", max_active_conversations=3)
        r = asyncio.run(run_conversations(convs, cfg, WordTokenizer()))
        bodies = list(server.bodies)
    answer = "tok0 tok1 tok2 "  # the fake server's completion of 3 tokens
    for c in convs:
        prompts = [b["prompt"] for b in bodies if b["prompt"].startswith(f"User: {c.user_turns[0]}")]
        history = []
        expected = []
        for u in c.user_turns:
            expected.append(render(history, u))
            history.append((u, answer))
        assert prompts == expected  # in order, each with the earlier answers
    assert all(b["ignore_eos"] and b["max_tokens"] == 3 and b["temperature"] == 0.0 for b in bodies)
    first_turns = [i for i, b in enumerate(bodies) if b["prompt"].count("User:") == 1]
    assert first_turns == [0, 1, 2]  # every conversation starts before any second turn: turns interleave
    assert r["completed"] == len(bodies) == sum(len(c.user_turns) for c in convs) and r["failed"] == 0
    assert [t["turn"] for t in r["per_turn"]] == list(range(1, max(len(c.user_turns) for c in convs) + 1))
    assert r["per_turn"][0]["requests"] == 3 and r["per_turn"][0]["median_ttft_ms"] > 0
    assert r["prefix_cache_hit_rate"] is None and "answered 404" in r["prefix_cache_note"]


def test_a_conversation_stops_before_the_context_limit(sharegpt):
    convs, _ = sample_conversations(WordTokenizer(), 1, max_turns=5, min_turns=5, dataset=sharegpt, output_len=3)
    with FakeServer() as server:
        cfg = MultiTurnConfig(base_url=server.url, model="fake-model", max_context_len=30)
        r = asyncio.run(run_conversations(convs, cfg, WordTokenizer()))
    # turn k's prompt: BOS + 5 words + 8 per earlier turn (question, answer of 3): 6, 14, 22, 30 > 30 - 3
    assert r["completed"] == 3 and r["conversations_cut_short"] == ["c3: stopped before turn 4 (30 + 3 tokens)"]


def test_prefix_cache_counters_from_the_servers_own_metrics():
    from spanllm.serve.metrics import ServerMetrics

    class Stats:
        prompt_tokens = generation_tokens = preemptions = 0
        prefix_cache_queries, prefix_cache_hits = 1000, 640

    class Core:
        num_running = num_waiting = 0
        stats = Stats()

        class blocks:  # noqa: N801
            usage = 0.0

    m = ServerMetrics("m")
    m.update_engine(Core())
    before = parse_prefix_cache_counters(m.render().decode())
    assert before == (1000.0, 640.0)
    Core.stats.prefix_cache_queries, Core.stats.prefix_cache_hits = 1500, 1040
    m.update_engine(Core())
    after = parse_prefix_cache_counters(m.render().decode())
    r = prefix_cache_result(before, after)
    assert r == {"prefix_cache_queries": 500, "prefix_cache_hits": 400, "prefix_cache_hit_rate": 0.8}
    vllm = '# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{a="1"} 7\n'
    assert "no *prefix_cache_hits_total" in parse_prefix_cache_counters(vllm)
    assert prefix_cache_result("no page", after) == {"prefix_cache_hit_rate": None, "prefix_cache_note": "no page"}


def test_metrics_reads_honour_the_request_timeout(sharegpt):
    """A server that never answers: every read, /metrics included, gives up after request_timeout_s (the /metrics
    reads once waited 30 s each, whatever the timeout)."""
    import socket

    convs, _ = sample_conversations(WordTokenizer(), 1, max_turns=2, min_turns=1, seed=0, dataset=sharegpt)
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = MultiTurnConfig(base_url=url, model="m", request_timeout_s=0.5)
        r = asyncio.run(asyncio.wait_for(run_conversations(convs, cfg, WordTokenizer()), 10))
    assert r["completed"] == 0 and r["failed"] == 1
    assert r["prefix_cache_hit_rate"] is None
    assert r["prefix_cache_note"].startswith(f"GET {url}/metrics failed: TimeoutError")


def test_model_listing_honours_the_request_timeout(monkeypatch, capsys):
    """Without --model the command asks GET /v1/models with --request-timeout as its timeout."""
    import spanllm.bench.serve_client
    from spanllm.cli import main
    from spanllm.errors import SpanllmError

    asked = []

    async def first_model(session, base_url, timeout_s=30.0):
        asked.append(timeout_s)
        raise SpanllmError("no server")

    monkeypatch.setattr(spanllm.bench.serve_client, "first_model", first_model)
    argv = ["bench", "multi-turn", "--base-url", "http://127.0.0.1:9", "--request-timeout", "0.5"]
    assert main(argv) == 1
    assert asked == [0.5] and "no server" in capsys.readouterr().err
