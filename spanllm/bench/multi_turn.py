"""Multi-turn ShareGPT against an OpenAI-compatible server: each conversation's user turns replayed in order, each
turn's prompt the whole conversation so far (the model's own earlier answers included), turns of different
conversations interleaved, so that what a prefix cache keeps between turns shows in the time to first token.

The shape of vLLM's `benchmarks/multi_turn` (clients hold conversations and resend the history each turn) and of
SGLang's `hicache/bench_serving.py --enable-multiturn` (ShareGPT conversations, turns of different conversations
interleaved): conversations start at `--request-rate` per second (Poisson; inf: all at once), at most
`--max-active-conversations` at a time; a conversation sends its next turn as soon as its previous answer is
complete. A turn asks for as many tokens as the ShareGPT answer it replaces has (capped by --max-output-len, or
--output-len for all), with ignore_eos, so the lengths do not depend on the model.

Prompt format (completions endpoint, one text per turn, so every turn's text starts with the previous turn's
text and answer): "User: {turn 1}\\n\\nAssistant: {answer 1}\\n\\nUser: {turn 2}\\n\\nAssistant:". A conversation
ends early (and says so in the result) when its next prompt plus answer would pass --max-context-len tokens.
Reported: TTFT (mean, median, p99) and prompt length per turn number, overall TTFT, and the server's prefix-cache
hit rate over the run (from /metrics, when it has the counters).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from spanllm.bench.datasets import ShareGPTRecords, count_tokens, load_sharegpt
from spanllm.bench.prefix_cache_metrics import prefix_cache_counters, prefix_cache_result
from spanllm.bench.serve_client import RequestInput, send_request
from spanllm.bench.serve_metrics import arrival_offsets_s
from spanllm.errors import UsageError
from spanllm.output_files import write_json


@dataclass(frozen=True)
class Conversation:
    id: str
    user_turns: tuple[str, ...]
    output_lens: tuple[int, ...]  # tokens to generate after each user turn
    answers: tuple[str, ...] = ()  # the ShareGPT answers the lengths come from (kept for save_conversations)


def sample_conversations(
    tokenizer,
    num_conversations: int,
    max_turns: int = 8,
    min_turns: int = 2,
    seed: int = 0,
    dataset: ShareGPTRecords | str | None = None,
    output_len: int | None = None,
    max_output_len: int = 256,
) -> tuple[list[Conversation], dict[str, Any]]:
    """num_conversations ShareGPT conversations (shuffled with seed) that alternate human / gpt from a human turn
    and have at least min_turns human turns; their first max_turns turns. Output lengths: the gpt answer's token
    count (without BOS) clamped to [4, max_output_len], or output_len for every turn."""
    if num_conversations < 1 or min_turns < 1 or max_turns < min_turns:
        raise UsageError(
            f"need --num-conversations >= 1 and 1 <= --min-turns <= --max-turns; got {num_conversations}, "
            f"{min_turns}, {max_turns}"
        )
    if (output_len is not None and output_len < 1) or max_output_len < 1:
        raise UsageError(f"--output-len and --max-output-len must be >= 1, got {output_len}, {max_output_len}")
    src = dataset if isinstance(dataset, ShareGPTRecords) else load_sharegpt(dataset)
    records = list(src.conversations)
    random.Random(seed).shuffle(records)
    n_special = len(tokenizer.encode(""))
    out: list[Conversation] = []
    for rec in records:
        turns = rec["conversations"]
        users, answers = [], []
        for k in range(0, len(turns) - 1, 2):
            h, g = turns[k], turns[k + 1]
            if h.get("from") != "human" or g.get("from") != "gpt" or not h.get("value"):
                break
            users.append(h["value"])
            answers.append(g["value"])
            if len(users) == max_turns:
                break
        if len(users) < min_turns:
            continue
        if output_len is None:
            lens = [min(max(n - n_special, 4), max_output_len) for n in count_tokens(tokenizer, answers)]
        else:
            lens = [output_len] * len(users)
        out.append(Conversation(str(rec.get("id", len(out))), tuple(users), tuple(lens), tuple(answers)))
        if len(out) == num_conversations:
            break
    if len(out) < num_conversations:
        raise UsageError(
            f"only {len(out)} conversations of {src.path} have >= {min_turns} human turns; asked for "
            f"{num_conversations}: lower --num-conversations or --min-turns"
        )
    info = {
        "dataset_name": "sharegpt-multi-turn",
        "seed": seed,
        "num_conversations": len(out),
        "turns": sum(len(c.user_turns) for c in out),
        "max_turns": max_turns,
        "min_turns": min_turns,
        "output_len": output_len,
        "max_output_len": max_output_len,
        **src.info(),
    }
    return out, info


def save_conversations(conversations: list[Conversation], path: str, flag: str = "--save-conversations") -> None:
    """The sampled conversations (their replayed turns) as a ShareGPT file: `--dataset-path` of it samples the
    same conversations and lengths again (for a machine without the ShareGPT package)."""
    records = [
        {
            "id": c.id,
            "conversations": [
                m
                for u, a in zip(c.user_turns, c.answers)
                for m in ({"from": "human", "value": u}, {"from": "gpt", "value": a})
            ],
        }
        for c in conversations
    ]
    write_json(flag, path, records, ensure_ascii=False)


def render(history: list[tuple[str, str]], user: str) -> str:
    """The conversation so far as one completion prompt (module docstring's format)."""
    parts = [f"User: {u}\n\nAssistant: {a}\n\n" for u, a in history]
    return "".join(parts) + f"User: {user}\n\nAssistant:"


@dataclass(frozen=True)
class MultiTurnConfig:
    base_url: str
    model: str
    request_rate: float = math.inf  # conversation starts per second
    max_active_conversations: int = 32
    max_context_len: int = 8192  # prompt + answer tokens; a conversation stops before passing it
    request_timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise UsageError(f"--request-rate must be > 0 or inf, got {self.request_rate}")
        if self.max_active_conversations < 1:
            raise UsageError(f"--max-active-conversations must be >= 1, got {self.max_active_conversations}")
        if self.max_context_len < 2:
            raise UsageError(f"--max-context-len must be >= 2, got {self.max_context_len}")
        if not self.request_timeout_s > 0:
            raise UsageError(f"--request-timeout must be > 0 s, got {self.request_timeout_s}")


async def run_conversations(conversations: list[Conversation], cfg: MultiTurnConfig, tokenizer) -> dict[str, Any]:
    """Replay every conversation; return the per-turn records and the summary (`summarize`)."""
    import aiohttp

    api_url = cfg.base_url.rstrip("/") + "/v1/completions"
    records: list[dict[str, Any]] = []
    cut: list[str] = []
    sem = asyncio.Semaphore(cfg.max_active_conversations)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, trust_env=True) as session:

        async def one(conv: Conversation, offset: float, start: float) -> None:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                history: list[tuple[str, str]] = []
                for turn, (user, n_out) in enumerate(zip(conv.user_turns, conv.output_lens)):
                    prompt = render(history, user)
                    prompt_len = len(tokenizer.encode(prompt))
                    if prompt_len + n_out > cfg.max_context_len:
                        cut.append(f"{conv.id}: stopped before turn {turn + 1} ({prompt_len} + {n_out} tokens)")
                        return
                    inp = RequestInput(prompt, prompt_len, n_out, cfg.model, api_url, ignore_eos=True)
                    out = await send_request(session, inp, cfg.request_timeout_s)
                    records.append(
                        {
                            "conversation": conv.id,
                            "turn": turn + 1,
                            "prompt_len": out.prompt_len,
                            "output_tokens": out.output_tokens,
                            "ttft": out.ttft if out.success else None,
                            "latency": out.latency if out.success else None,
                            "start_time": out.start_time - start,
                            "error": out.error or None,
                        }
                    )
                    if not out.success:
                        return  # the rest of this conversation would resend a history without this answer
                    history.append((user, out.generated_text))

        cache0 = await prefix_cache_counters(session, cfg.base_url, cfg.request_timeout_s)
        offsets = arrival_offsets_s(len(conversations), cfg.request_rate, 1.0, cfg.seed)
        start = time.perf_counter()
        await asyncio.gather(*(one(c, o, start) for c, o in zip(conversations, offsets)))
        duration = time.perf_counter() - start
        cache1 = await prefix_cache_counters(session, cfg.base_url, cfg.request_timeout_s)
    return {
        **summarize(records, duration),
        **prefix_cache_result(cache0, cache1),
        "conversations_cut_short": cut,
        "requests": records,
    }


def summarize(records: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """TTFT and prompt length per turn number (successful requests), overall TTFT, throughput."""
    ok = [r for r in records if r["ttft"] is not None]
    per_turn = []
    for turn in sorted({r["turn"] for r in records}):
        rs = [r for r in ok if r["turn"] == turn]
        ttft = np.asarray([r["ttft"] for r in rs]) * 1e3
        per_turn.append(
            {
                "turn": turn,
                "requests": len(rs),
                "failed": sum(1 for r in records if r["turn"] == turn and r["ttft"] is None),
                "mean_prompt_len": float(np.mean([r["prompt_len"] for r in rs])) if rs else None,
                "mean_ttft_ms": float(ttft.mean()) if rs else None,
                "median_ttft_ms": float(np.median(ttft)) if rs else None,
                "p99_ttft_ms": float(np.percentile(ttft, 99)) if rs else None,
            }
        )
    all_ttft = np.asarray([r["ttft"] for r in ok]) * 1e3
    return {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": sum(r["prompt_len"] for r in ok),
        "total_output_tokens": sum(r["output_tokens"] for r in ok),
        "output_throughput": sum(r["output_tokens"] for r in ok) / duration_s if duration_s > 0 else None,
        "mean_ttft_ms": float(all_ttft.mean()) if ok else None,
        "median_ttft_ms": float(np.median(all_ttft)) if ok else None,
        "p99_ttft_ms": float(np.percentile(all_ttft, 99)) if ok else None,
        "per_turn": per_turn,
    }
