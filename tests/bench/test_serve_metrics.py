"""bench serve's arrival process (vLLM's seeded gamma gaps, rescaled to N / rate) and its metrics on hand-made
timings whose results are computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spanllm.bench.serve_client import RequestOutput, SSEReader, token_text
from spanllm.bench.serve_metrics import arrival_offsets_s, calculate_metrics, parse_goodput, parse_rates


def vllm_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """vLLM's get_request, literally: global numpy seed, one gamma draw per request, cumulate, rescale."""
    np.random.seed(seed)
    delays = [np.random.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)) for _ in range(n)]
    for i in range(1, n):
        delays[i] += delays[i - 1]
    factor = (n / rate) / delays[-1]
    return [d * factor for d in delays]


@pytest.mark.parametrize("rate,burstiness,seed", [(4.0, 1.0, 0), (0.5, 0.3, 1), (32.0, 3.0, 7)])
def test_arrivals_equal_vllms(rate, burstiness, seed):
    got = arrival_offsets_s(200, rate, burstiness, seed)
    assert got == pytest.approx(vllm_delays(200, rate, burstiness, seed), rel=1e-12)
    assert got[-1] == pytest.approx(200 / rate, rel=1e-12)  # the total span is exactly N / rate
    assert all(b >= a for a, b in zip(got, got[1:])) and got[0] > 0
    assert arrival_offsets_s(200, rate, burstiness, seed) == got
    assert arrival_offsets_s(200, rate, burstiness, seed + 1) != got


def test_arrival_gaps_have_the_gamma_shape():
    n, rate = 40000, 10.0
    for b in (1.0, 0.25, 4.0):
        gaps = np.diff([0.0] + arrival_offsets_s(n, rate, b, seed=0))
        assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)  # rescaled: exactly span / n
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(b), rel=0.05)  # CV of gamma(b)
    assert arrival_offsets_s(4, math.inf) == [0.0] * 4
    assert arrival_offsets_s(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError):
        arrival_offsets_s(4, 0.0)
    with pytest.raises(ValueError):
        arrival_offsets_s(4, 1.0, burstiness=0.0)


def _out(ttft, itl, latency, tokens, prompt_len, start, queue=0.0):
    return RequestOutput(
        success=True,
        ttft=ttft,
        itl=list(itl),
        latency=latency,
        output_tokens=tokens,
        prompt_len=prompt_len,
        start_time=start,
        chunks=len(itl) + 1,
        client_queue_time=queue,
    )


def test_metrics_by_hand():
    outputs = [
        _out(0.1, [0.02, 0.03, 0.05], 0.2, 4, 10, 0.0),  # TPOT (0.2 - 0.1) / 3
        _out(0.3, [0.1], 0.4, 2, 20, 0.1),  # TPOT 0.1 / 1
        RequestOutput(success=False, error="HTTP 500", prompt_len=7, start_time=0.12),
        _out(0.05, [], 0.05, 1, 5, 0.15),
    ]  # one token: no TPOT (0 for goodput)
    m = calculate_metrics(
        outputs,
        duration_s=2.0,
        percentiles=(50, 99, 99.9),
        percentile_metrics=("ttft", "tpot", "itl", "e2el"),
        goodput={"ttft": 200, "tpot": 50},
    )
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (35, 7)  # the failed request counts nowhere
    assert m["output_lens"] == [4, 2, 0, 1]
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(21.0)
    # TTFT [0.1, 0.3, 0.05]: mean 150, median 100, std sqrt(0.035 / 3), p99 = 0.1 + 0.98 * 0.2 (linear)
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["std_ttft_ms"] == pytest.approx(1000 * math.sqrt(0.035 / 3))
    assert m["p99_ttft_ms"] == pytest.approx(296.0)
    assert m["p50_ttft_ms"] == pytest.approx(100.0)
    assert m["p99.9_ttft_ms"] == pytest.approx(1000 * (0.1 + 0.998 * 0.2))
    # TPOT [1/30, 0.1]
    assert m["mean_tpot_ms"] == pytest.approx(1000 * (1 / 30 + 0.1) / 2)
    assert m["p99_tpot_ms"] == pytest.approx(1000 * (1 / 30 + 0.99 * (0.1 - 1 / 30)))
    # ITL pooled [0.02, 0.03, 0.05, 0.1]
    assert m["mean_itl_ms"] == pytest.approx(50.0)
    assert m["median_itl_ms"] == pytest.approx(40.0)
    assert m["mean_e2el_ms"] == pytest.approx(1000 * 0.65 / 3)
    # goodput: request 1 (ttft 100 <= 200, tpot 33 <= 50) and request 4 (50, 0) are good; 2 misses TTFT
    assert m["request_goodput"] == pytest.approx(1.0)
    # all three in flight at t = 0.15; the tokens span 0.5 s (first start to last token): one window of 0.5 s
    # holds all 7, 14 tok/s; never below the average (7 tokens / 2 s)
    assert m["max_concurrent_requests"] == 3 and m["max_output_tokens_per_s"] == pytest.approx(14.0)
    assert m["max_output_tokens_per_s"] >= m["output_throughput"]


def test_metrics_defaults_and_fallbacks():
    o = _out(0.1, [0.1, 0.1], 0.3, 0, 3, 0.0, queue=0.5)  # no usage chunk: 3 token chunks
    m = calculate_metrics([o], 1.0)
    assert m["total_output_tokens"] == 3 and m["request_goodput"] is None
    assert "p99_ttft_ms" in m and "p99_e2el_ms" not in m and "mean_e2el_ms" in m  # vLLM's default selection
    assert calculate_metrics([o], 1.0, count_output_tokens=lambda text: 9)["total_output_tokens"] == 9
    q = calculate_metrics([o], 1.0, percentile_metrics=("client_queue_time",))
    assert q["mean_client_queue_time_ms"] == pytest.approx(500.0)
    empty = calculate_metrics([RequestOutput(error="x")], 1.0)  # nothing completed: zeros, as vLLM
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] == 0.0 and empty["max_concurrent_requests"] == 0
    with pytest.raises(ValueError, match="unknown metric"):
        calculate_metrics([o], 1.0, percentile_metrics=("ttfb",))


def test_parse_goodput_and_rates():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1e4"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["tpot:-1"], ["tpot:fast"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_rates("1, 2,4,inf") == [1.0, 2.0, 4.0, math.inf]
    with pytest.raises(ValueError):
        parse_rates("1,0")
    with pytest.raises(ValueError):
        parse_rates("1,x")


def test_sse_reader_and_token_chunks():
    r = SSEReader()
    data = b'data: {"a": 1}\r\n\r\n: ping\n\ndata: {"b":\ndata: 2}\n\ndata: [DONE]\n\n'
    events = []
    for i in range(0, len(data), 3):  # arbitrary splits, including inside a line and a CRLF
        events += r.feed(data[i : i + 3])
    assert events == ['{"a": 1}', '{"b":\n2}', "[DONE]"]
    raw, r = 'data: "é"\n\n'.encode(), SSEReader()
    assert r.feed(raw[:8]) == [] and r.feed(raw[8:]) == ['"é"']  # a UTF-8 character split across reads
    assert token_text({"choices": [{"text": "x", "finish_reason": None}]}, chat=False) == "x"
    assert token_text({"choices": [{"text": "", "finish_reason": None}]}, chat=False) == ""  # special token
    assert token_text({"choices": [{"text": "", "finish_reason": "length"}]}, chat=False) is None
    assert token_text({"choices": [], "usage": {}}, chat=False) is None
    assert token_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, chat=True) is None
    assert token_text({"choices": [{"delta": {"content": "y"}, "finish_reason": "stop"}]}, chat=True) == "y"
    assert token_text({"choices": [{"delta": {}, "finish_reason": "stop"}]}, chat=True) is None
