"""bench serve end to end against a fake OpenAI-compatible streaming server started in the test (free port):
counts, token totals, the request body vLLM's client sends, failures, timeouts, rate and concurrency caps, and
the CLI sweep writing its table, JSON and PNG."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

pytest.importorskip("aiohttp", reason="bench serve's client needs aiohttp")

from fake_openai_server import FakeServer  # noqa: E402

from spanllm.bench.datasets import SampleRequest  # noqa: E402
from spanllm.cli import main  # noqa: E402
from spanllm.commands import bench_serve as serve  # noqa: E402
from spanllm.commands.bench_serve import ServeBenchConfig, run_benchmark  # noqa: E402


class WordTokenizer:
    """BOS + one token per word."""

    def encode(self, text: str) -> list[int]:
        return [0] + [len(w) for w in text.split()]


def make_samples() -> list[SampleRequest]:
    return [SampleRequest(" ".join(["w"] * (i + 2)), i + 3, 3 + i % 4) for i in range(10)] + [
        SampleRequest("please FAIL now", 4, 5),
        SampleRequest("also FAIL", 3, 2),
    ]


@pytest.fixture(scope="module")
def server():
    with FakeServer() as s:
        yield s


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_counts_tokens_and_request_body(server, endpoint):
    samples = make_samples()
    server.bodies.clear()
    r = run_benchmark(
        samples, ServeBenchConfig(base_url=server.url, endpoint=endpoint, ignore_eos=True, show_progress=False)
    )
    ok = samples[:10]
    assert (r["completed"], r["failed"], r["num_prompts"]) == (10, 2, 12)
    assert r["model_id"] == "fake-model"  # the first of GET /v1/models
    assert r["backend"] == ("openai-chat" if "chat" in endpoint else "openai")
    # the server's usage chunk: prompt tokens = words, completion tokens = max_tokens
    assert r["total_input_tokens"] == sum(len(s.prompt.split()) for s in ok)
    assert r["total_output_tokens"] == sum(s.output_len for s in ok)
    assert r["output_lens"] == [s.output_len for s in ok] + [0, 0]
    # one timed chunk per token: no role header, no bare finish chunk
    assert [len(x) for x in r["itls"][:10]] == [s.output_len - 1 for s in ok]
    assert r["generated_texts"][0] == "tok0 tok1 tok2 "
    assert all(r["ttfts"][i] > 0 and r["latencies"][i] >= r["ttfts"][i] for i in range(10))
    assert list(r["error_counts"].values()) == [2] and "HTTP 400" in next(iter(r["error_counts"]))
    assert r["request_rate"] == "inf" and r["max_concurrency"] is None and r["request_goodput"] is None
    for key in (
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "duration",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "p99_itl_ms",
        "median_e2el_ms",
    ):
        assert r[key] > 0, key
    first = samples[0].prompt  # the server may see the requests in any order
    body = next(b for b in server.bodies if (b["messages"][0]["content"] if "messages" in b else b["prompt"]) == first)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["model"] == "fake-model"
    assert body["temperature"] == 0.0  # greedy unless asked, as vLLM's client (a server's own default would sample)
    assert ("messages" in body) == ("chat" in endpoint) and body["max_tokens"] == samples[0].output_len


def test_without_usage_counts_with_the_tokenizer():
    with FakeServer(usage=False) as s:
        samples = make_samples()[:4]
        r = run_benchmark(
            samples,
            ServeBenchConfig(base_url=s.url, model="fake-model", show_progress=False),
            tokenizer=WordTokenizer(),
        )
        assert r["completed"] == 4 and r["total_output_tokens"] == sum(x.output_len for x in samples)
        assert r["total_input_tokens"] == sum(x.prompt_len for x in samples)  # the samples' own counts
        r = run_benchmark(samples, ServeBenchConfig(base_url=s.url, model="m", show_progress=False))
        assert r["total_output_tokens"] == sum(x.output_len for x in samples)  # token chunks


def test_timeout_fails_the_request_and_nothing_hangs(server):
    samples = [SampleRequest("w w", 3, 2), SampleRequest("SLOW one", 3, 2)]
    r = run_benchmark(samples, ServeBenchConfig(base_url=server.url, request_timeout_s=0.5, show_progress=False))
    assert (r["completed"], r["failed"]) == (1, 1)
    assert "timed out after 0.5 s" in r["errors"][1] and r["duration"] < 5


def test_without_a_live_bar_a_status_line_says_how_many_answered(server, monkeypatch, capsys):
    """A server that keeps a request and never answers is seen before --request-timeout: a line on stderr every
    STATUS_LINE_S (here 0.2 s) while no progress bar shows."""
    monkeypatch.setattr(serve, "STATUS_LINE_S", 0.2)
    samples = [SampleRequest("w w", 3, 2), SampleRequest("SLOW one", 3, 2)]
    r = run_benchmark(samples, ServeBenchConfig(base_url=server.url, request_timeout_s=1.0, show_progress=False))
    assert (r["completed"], r["failed"]) == (1, 1)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("bench serve: ")]
    assert lines, "no status line"
    assert lines[0].startswith("bench serve: 1 of 2 requests answered, 1 in flight, ")
    assert lines[0].endswith(" s (--request-timeout 1 s)")


def test_a_step_before_the_requests_that_waits_is_named_in_the_status_line(server, monkeypatch, capsys):
    """A server that never answers /metrics held the run 30 s before any request, with no line: the status line
    covers every step and says which one it waits on."""
    monkeypatch.setattr(serve, "STATUS_LINE_S", 0.2)
    real = serve.prefix_cache_counters

    async def slow_counters(session, base_url, timeout_s):
        await asyncio.sleep(0.5)
        return await real(session, base_url, timeout_s)

    monkeypatch.setattr(serve, "prefix_cache_counters", slow_counters)
    r = run_benchmark([SampleRequest("w w", 3, 2)], ServeBenchConfig(base_url=server.url, show_progress=False))
    assert (r["completed"], r["failed"]) == (1, 0)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("bench serve: ")]
    assert lines and lines[0].startswith("bench serve: reading the server's prefix-cache counters (/metrics), ")


def test_unreachable_server_is_a_clear_error():
    with FakeServer() as s:
        url = s.url
    with pytest.raises(Exception, match="could not list models"):
        run_benchmark(make_samples()[:1], ServeBenchConfig(base_url=url, show_progress=False))
    r = run_benchmark(
        make_samples()[:2], ServeBenchConfig(base_url=url, model="m", show_progress=False, request_timeout_s=5)
    )
    assert r["failed"] == 2 and r["completed"] == 0


def test_rate_concurrency_warmup_and_goodput(server):
    samples = make_samples()[:10]
    server.bodies.clear()
    server.max_in_flight = 0
    r = run_benchmark(
        samples,
        ServeBenchConfig(
            base_url=server.url,
            request_rate=20.0,
            burstiness=0.5,
            max_concurrency=2,
            num_warmups=3,
            goodput={"ttft": 10_000},
            percentile_metrics=("ttft", "client_queue_time"),
            show_progress=False,
        ),
    )
    assert r["completed"] == 10 and len(server.bodies) == 13  # 3 warm-ups, not counted
    assert r["duration"] >= 10 / 20.0  # the last request leaves at N / rate
    assert r["max_concurrent_requests"] <= 2 and server.max_in_flight <= 2
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert "p99_client_queue_time_ms" in r and r["max_concurrency"] == 2 and r["request_rate"] == 20.0


def _write_sharegpt(path, n: int, truncate: bool) -> None:
    records = [
        {
            "id": f"r{i}",
            "conversations": [
                {"from": "human", "value": " ".join(["w"] * (4 + i % 7))},
                {"from": "gpt", "value": " ".join(["a"] * (3 + i % 5))},
            ],
        }
        for i in range(n)
    ]
    text = json.dumps(records, indent=1)
    path.write_text(text[:-40] if truncate else text)


def test_cli_sweep_writes_table_json_png(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: WordTokenizer())
    data = tmp_path / "sharegpt.json"
    _write_sharegpt(data, 30, truncate=True)
    out = tmp_path / "res"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--dataset-path",
            str(data),
            "--num-prompts",
            "12",
            "--request-rate",
            "50,inf",
            "--result-dir",
            str(out),
            "--result-filename",
            "sweep.json",
            "--metric-percentiles",
            "50,99",
            "--goodput",
            "ttft:5000",
            "--disable-tqdm",
            "--metadata",
            "gpu=none",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0
    assert "TTFT p99" in captured.out and "Serving Benchmark Result" in captured.out
    assert "recovered its first 29 complete records" in captured.err
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["kind"] == "bench_serve_sweep" and "machine" in doc and "versions" in doc
    assert doc["settings"]["request_rates"] == ["50", "inf"] and doc["settings"]["gpu"] == "none"
    assert "NOT vLLM's sample" in doc["dataset_note"] and doc["dataset"]["records_complete"] == 29
    runs = doc["rows"]
    assert [r["request_rate"] for r in runs] == [50.0, "inf"]
    assert all(r["completed"] == 12 and r["failed"] == 0 for r in runs)
    assert all(r["total_output_tokens"] == runs[0]["total_output_tokens"] for r in runs)  # same requests
    assert "p50_tpot_ms" in runs[0] and "ttfts" not in runs[0]  # per-request arrays only with --save-detailed
    png = out / "sweep.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_single_rate_saves_vllm_json(server, tmp_path, monkeypatch, capsys):
    try:  # the engine's tokenizers (the `tiny` preset: bytes); else a stand-in
        import spanllm.engine.tokenizer  # noqa: F401
    except ImportError:
        monkeypatch.setattr(serve, "load_tokenizer", lambda name: WordTokenizer())
    data = tmp_path / "sharegpt.json"
    _write_sharegpt(data, 10, truncate=False)
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--dataset-path",
            str(data),
            "--num-prompts",
            "5",
            "--tokenizer",
            "tiny",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(tmp_path),
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    files = list(tmp_path.glob("openai-infqps-fake-model-*.json"))  # vLLM's file name
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["completed"] == 5 and doc["request_rate"] == "inf" and doc["tokenizer_id"] == "tiny"
    assert len(doc["ttfts"]) == 5 and doc["dataset"]["file_truncated"] is False and "dataset_note" not in doc
    assert not math.isnan(doc["mean_ttft_ms"])
    capsys.readouterr()


def test_cli_rejects_bad_flags(server, capsys):
    assert main(["bench", "serve", "--base-url", server.url, "--request-rate", "0"]) == 2
    assert main(["bench", "serve", "--base-url", server.url, "--goodput", "itl:5"]) == 2
    assert "--goodput" in capsys.readouterr().err


def test_progress_bar_and_ready_check(server, capsys):
    samples = make_samples()[:3]
    r = run_benchmark(samples, ServeBenchConfig(base_url=server.url, ready_check_timeout_s=5, show_progress=True))
    assert r["completed"] == 3 and "3/3" in capsys.readouterr().err  # rich's bar, on stderr
    with pytest.raises(Exception, match="not ready after 1 s"):
        run_benchmark(
            [SampleRequest("FAIL", 2, 2)],
            ServeBenchConfig(base_url=server.url, ready_check_timeout_s=1, show_progress=False),
        )


def test_cli_sweep_writes_nothing_without_result_dir(server, tmp_path, monkeypatch, capsys):
    """Files only where --result-dir says: a sweep without it prints its table and leaves the cwd as it was."""
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: WordTokenizer())
    data = tmp_path / "sharegpt.json"
    _write_sharegpt(data, 12, truncate=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    args = ["bench", "serve", "--base-url", server.url, "--dataset-path", str(data), "--num-prompts", "6"]
    rc = main([*args, "--request-rate", "50,inf", "--disable-tqdm"])
    assert rc == 0 and list(cwd.iterdir()) == []
    assert "no files written" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--temperature", "3"], "--temperature 3.0: must be in [0.0, 2.0]"),
        (["--top-p", "0"], "--top-p 0.0: must be in (0.0, 1.0]"),
        (["--port", "0"], "--port 0: must be in [1, 65535]"),
        (["--num-prompts", "0"], "--num-prompts 0: must be in [1,"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio 1.5: must be in [0, 1)"),
        (["--save-result"], "--save-result writes into --result-dir"),
        (["--top-p", "0.5"], "--top-p: the requests decode greedily (--temperature 0, the default 0 as vLLM's client)"),
        (["--top-k", "5", "--temperature", "0"], "--top-k: the requests decode greedily (--temperature 0"),
    ],
)
def test_cli_numbers_are_checked(flags, words, capsys):
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *flags])
    assert rc == 2 and words in capsys.readouterr().err


def test_sweep_flags_a_later_rate_served_from_the_cache_the_earlier_rates_filled(server, monkeypatch, capsys):
    """The server's /metrics counters as a caching server would move them: the first rate's prompts miss, the second
    rate's (the same prompts) hit 96% of their tokens. Only the second run is flagged, and the CLI's report says so."""
    counters = iter([(0.0, 0.0), (100.0, 0.0), (100.0, 0.0), (200.0, 96.0)])

    async def fake_counters(*args, **kwargs):
        return next(counters)

    monkeypatch.setattr(serve, "prefix_cache_counters", fake_counters)
    cfg = ServeBenchConfig(base_url=server.url, ignore_eos=True, show_progress=False)
    runs = serve.run_sweep(make_samples()[:4], cfg, [50.0, math.inf])
    assert [r["prefix_cache_hit_rate"] for r in runs] == [0.0, 0.96]
    assert "prefix_cache_warning" not in runs[0]
    assert runs[1]["prefix_cache_warning"].startswith("96% of this rate's prompt tokens hit the server's prefix cache")
    assert "the same 4 prompts" in runs[1]["prefix_cache_warning"]
    assert "--no-enable-prefix-caching" in runs[1]["prefix_cache_warning"]


def test_metrics_reads_are_bounded_by_a_shorter_request_timeout(server, monkeypatch):
    seen = []

    async def counters(session, base_url, timeout_s):
        seen.append(timeout_s)
        return "not read"

    monkeypatch.setattr(serve, "prefix_cache_counters", counters)
    for timeout in (3.0, 1800.0):
        run_benchmark(
            make_samples()[:2], ServeBenchConfig(base_url=server.url, request_timeout_s=timeout, show_progress=False)
        )
    assert seen == [3.0, 3.0, 30.0, 30.0]  # before and after each run: --request-timeout, at most 30 s
