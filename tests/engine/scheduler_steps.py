"""Running a scheduler's steps in a test as the engine runs them, without a model."""

from __future__ import annotations

from spanllm.engine.core.scheduler import Scheduler
from spanllm.engine.core.sequence import FinishReason, Sequence

SAMPLED = 7  # the token every sampling step appends


def run_step(sched: Scheduler, batch) -> list[Sequence]:
    """What the engine does after a step: advance what ran, append SAMPLED where the step samples, finish (by length)
    the sequences that reached max_tokens; returns those."""
    finished = []
    for seq, n in batch.entries:
        samples = seq.num_computed + n == seq.num_tokens
        seq.num_computed += n
        if samples:
            seq.output_ids.append(SAMPLED)
            if seq.num_output >= seq.params.max_tokens:
                sched.finish(seq)
                seq.finish(FinishReason.LENGTH)
                finished.append(seq)
    return finished
