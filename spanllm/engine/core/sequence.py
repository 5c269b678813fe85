"""Sequence: one request inside the serving engine, from arrival to its finish (or abort).

Token ids: the prompt, then the generated ids. `num_computed` counts the positions whose K/V are in
the cache; the scheduler advances it as prefill chunks and decode steps run (at admission it starts at
the tokens the prefix cache already holds), and a preemption (by recompute) resets it to 0 with the blocks
freed: the request then prefills its prompt and what it had generated so far again (what of it is still
cached is taken from the cache), and goes on where it stopped (its output is kept).

With async scheduling a sampled token can be on the device only: `num_pending` counts them (0, or 1
while the step after the one that sampled it is planned; 2 for a moment while that step samples again).
They count in `num_tokens`, so the scheduler plans the next decode as if the token were there, and the
plan takes its id from the device (`pending_row`: its row in the newest in-flight sample).

Timestamps are `time.monotonic()` seconds (what a serving benchmark needs): arrival, first scheduled,
first token, every token, finish.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from spanllm.engine.sampler import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # abort_request (a client went away, shutdown)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop id or string that ended it (vLLM's stop_reason)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose K/V are cached
    # Prefix caching (BlockManager): keys of the full blocks of its tokens so far (computed once), how many of
    # its table's blocks are registered, and the tokens the cache gave it at its latest admission.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    family: bytes | None = None  # scheduling_policy="prefix": the key of its prompt's first blocks (scheduler)
    queue_key: int = 0  # its place in the waiting queue, smaller first (scheduler; a preempted one goes first)
    num_preemptions: int = 0
    num_pending: int = 0  # sampled on the device, not yet appended on the host (async scheduling)
    pending_row: int = -1  # the newest pending token's row in its step's sampled tensor
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None
    # Filled by the engine for text requests: output text so far, and the index into it that was returned.
    text: str = ""
    text_emitted: int = 0  # characters of `text` already handed out as deltas (stop-string hold-back)
    generator: object = None  # torch.Generator of a seeded request (created at its first sampled token)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    def token_at(self, i: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[i] if i < p else self.output_ids[i - p]

    def tokens(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p : stop - p]
        return self.prompt_ids[start:] + self.output_ids[: stop - p]

    @property
    def num_uncomputed(self) -> int:
        """Positions still to run before the next token can be sampled (>= 1 while running)."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_at = time.monotonic()
