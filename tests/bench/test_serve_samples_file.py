"""bench serve --samples-file: the requests saved by `bench throughput --save-samples` (the GPU machine cannot
hold the ShareGPT package), the first --num-prompts of them, in order; a bad file is a usage error (rc 2)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("aiohttp", reason="bench serve's client needs aiohttp")

from fake_openai_server import FakeServer  # noqa: E402

from spanllm.bench.datasets import SampleRequest, SampleSet  # noqa: E402
from spanllm.bench.sample_file import save_samples  # noqa: E402
from spanllm.cli import main  # noqa: E402
from spanllm.commands import bench_serve as serve  # noqa: E402


class WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return [0] + [len(w) for w in text.split()]


@pytest.fixture(scope="module")
def server():
    with FakeServer() as s:
        yield s


def _saved(path, n: int = 8) -> list[SampleRequest]:
    reqs = [SampleRequest(" ".join(["w"] * (i + 2)), i + 3, 2 + i % 3) for i in range(n)]
    save_samples(SampleSet(reqs, {"dataset_name": "sharegpt", "seed": 0, "num_requests": n}), str(path))
    return reqs


def test_sweep_from_samples_file(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: WordTokenizer())
    samples = tmp_path / "s.json"
    reqs = _saved(samples)
    server.bodies.clear()
    out = tmp_path / "res"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--samples-file",
            str(samples),
            "--num-prompts",
            "5",
            "--request-rate",
            "100,inf",
            "--ignore-eos",
            "--result-dir",
            str(out),
            "--result-filename",
            "sw.json",
            "--disable-tqdm",
        ]
    )
    assert rc == 0, capsys.readouterr()
    doc = json.loads((out / "sw.json").read_text())
    assert doc["dataset"]["samples_file"] == str(samples) and doc["dataset"]["samples_file_requests"] == 8
    assert doc["dataset"]["num_requests"] == 5 and "partial" not in doc["settings"]
    assert [r["completed"] for r in doc["rows"]] == [5, 5]
    assert all(r["total_output_tokens"] == sum(q.output_len for q in reqs[:5]) for r in doc["rows"])
    sent = sorted((b["prompt"], b["max_tokens"]) for b in server.bodies)  # the file's first 5, twice
    assert sent == sorted([(q.prompt, q.output_len) for q in reqs[:5]] * 2)
    assert (out / "sw.png").exists()


def test_num_prompts_larger_than_file_is_refused(tmp_path):
    """More requests asked than the file holds: refused, in both commands (it once sent the 3 without a word)."""
    from spanllm.commands.bench_throughput import requests_from_args
    from spanllm.errors import UsageError

    samples = tmp_path / "s.json"
    _saved(samples, 3)
    args = type("A", (), {"samples_file": str(samples), "num_prompts": 1000, "save_samples": None})()
    want = f"--num-prompts 1000: --samples-file {samples} holds 3 requests; give at most 3 or leave --num-prompts out"
    for read in (serve.samples_from_args, requests_from_args):
        with pytest.raises(UsageError) as e:
            read(args, None)
        assert str(e.value) == want


def test_bench_throughput_and_serve_take_the_same_first_requests(tmp_path):
    """Both commands read --samples-file through load_first_samples: the first --num-prompts requests (all for
    None), the file's size in the info; an empty file refused, also with --num-prompts."""
    from spanllm.bench.sample_file import load_first_samples
    from spanllm.commands.bench_throughput import requests_from_args
    from spanllm.errors import UsageError

    samples = tmp_path / "s.json"
    reqs = _saved(samples, 5)
    for n, want in [(2, 2), (None, 5), (5, 5)]:
        args = type("A", (), {"samples_file": str(samples), "num_prompts": n, "save_samples": None})()
        a, b = serve.samples_from_args(args, None), requests_from_args(args, None)
        assert [r.prompt for r in a] == [r.prompt for r in b] == [q.prompt for q in reqs[:want]]
        assert a.info == b.info and a.info["num_requests"] == want and a.info["samples_file_requests"] == 5
    empty = tmp_path / "e.json"
    save_samples(SampleSet([], {}), str(empty))
    for n in (None, 3):
        with pytest.raises(UsageError, match="holds no requests"):
            load_first_samples(str(empty), n)


def test_bad_samples_file_is_usage_error(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: WordTokenizer())
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["bench", "serve", "--base-url", server.url, "--samples-file", str(bad), "--disable-tqdm"]) == 2
    assert "--save-samples" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--dataset-path", "x.json"], "--dataset-path x.json"),
        (["--dataset-name", "random"], "--dataset-name random"),
        (["--random-input-len", "9"], "--random-input-len 9"),
        (["--output-len", "3"], "--output-len 3"),
        (["--no-oversample"], "--no-oversample"),
    ],
)
def test_options_that_sample_requests_are_refused_with_a_samples_file(tmp_path, capsys, extra, flag):
    """The requests come from the file: an option that would sample them differently is refused, not ignored."""
    samples = tmp_path / "s.json"
    _saved(samples, 3)
    for cmd in (["bench", "serve", "--base-url", "http://127.0.0.1:9"], ["bench", "throughput", "--model", "tiny"]):
        assert main([*cmd, "--samples-file", str(samples), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"spanllm: error: {flag}: the requests come from --samples-file {samples} (saved with their prompts and "
            f"lengths), which this option would not change; drop {flag.split()[0]}"
        )
