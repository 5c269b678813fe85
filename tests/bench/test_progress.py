"""`bench throughput`'s progress: LLM.generate's on_output hook sees every output of every step, and the bar
(spanllm.engine.progress) counts finished requests and output tokens; without a terminal there is no hook."""

from __future__ import annotations

import io
from types import SimpleNamespace

import torch
from rich.console import Console

from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.engine.progress import RequestProgress
from spanllm.engine.sampler import SamplingParams


def test_generate_calls_on_output_with_every_step_output():
    cfg = EngineConfig(dtype=torch.float32, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64)
    llm = LLM("tiny", cfg)
    try:
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 5, 1, 4)]
        plain = llm.generate(prompts, params)
        seen = []
        hooked = llm.generate(prompts, params, on_output=seen.append)
    finally:
        llm.close()
    assert [o.output_ids for o in hooked] == [o.output_ids for o in plain]  # greedy: the hook changes nothing
    by_request: dict[str, list] = {}
    for out in seen:
        by_request.setdefault(out.request_id, []).append(out)
    assert len(by_request) == 4
    for final in hooked:
        outs = by_request[final.request_id]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]  # finished once, last
        assert [t for o in outs for t in o.new_ids] == final.output_ids  # every token seen once, in order
    assert sum(len(o.new_ids) for o in seen) == 3 + 5 + 1 + 4


def _out(new: int, finished: bool):
    return SimpleNamespace(new_ids=[0] * new, finished=finished)


def test_bar_counts_requests_and_tokens_on_a_terminal():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)
    with RequestProgress(3, console=console) as bar:
        assert bar.on_output is not None
        for out in (_out(1, False), _out(1, False), _out(2, True), _out(4, True), _out(1, False), _out(3, True)):
            bar.on_output(out)
    assert (bar.finished, bar.output_tokens) == (3, 12)
    assert "3/3" in buf.getvalue() and "output tok/s" in buf.getvalue()


def test_no_bar_and_no_hook_without_a_terminal():
    buf = io.StringIO()
    with RequestProgress(3, console=Console(file=buf, force_terminal=False)) as bar:
        assert bar.on_output is None
    assert buf.getvalue() == ""
