"""FixedBatchExecutor: one fixed batch (B prompts, max_tokens new tokens each) through the serving engine's
worker, on every pipeline stage: `bench batch` and `bench study` (TP vs TP x PP), and `generate` at pp > 1.

It owns no model, cache or attention code: each stage runs the same ModelRunner (paged KV cache, attention
backend, CUDA graphs) that serves requests. What it owns is the fixed schedule and the pipeline's transfers:

- Blocks: sequence i gets its own run of cache blocks (block 0 stays reserved), enough for prompt + max_tokens.
- The batch is cut into M micro-batches. Prefill: each micro-batch's prompts in steps of at most the runner's
  token budget (max_num_batched_tokens; a longer prompt is split into chunks, which attend to their cached
  prefix). Decode: step s runs every micro-batch in order, one token per sequence.
- pp = 1: a decode step's input ids are the previous step's sampled tokens, taken on the device
  (StepInputs.prev_rows), so the host never waits for a token; with CUDA graphs a step is one replay.
- pp > 1: stage s receives a micro-batch's hidden state and residual from stage s-1, runs its layers and sends
  them on; the last stage samples and sends the tokens back to the first stage, which needs them as the next
  step's input. With M = 1 the stages take turns (the naive schedule); with M >= pp, stage s works on
  micro-batch m while stage s+1 works on m-1. Activations travel in the world group; tokens in a group of their
  own (one per TP rank: first and last stage), so at pp = 2, where both directions join the same two ranks, the
  two streams of messages never queue behind each other. Sends are posted asynchronously and completed at the
  end of each phase. Stage runners run eagerly (CUDA graphs need the whole model).

Every sequence decodes max_tokens - 1 steps after its prefill (the schedule is fixed); tokens after a stop
token are dropped from the result. Every rank returns the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from spanllm.engine.sampler import BatchSampler, SamplingParams
from spanllm.engine.timers import Breakdown, Timers, WallClock
from spanllm.engine.worker.model_runner import ModelRunner, StepInputs
from spanllm.model.parallel_dims import ParallelGroups


class GenerationError(ValueError):
    """A fixed batch the engine cannot run (too long, too many blocks, bad micro-batching)."""


@dataclass
class GenerationOutput:
    token_ids: list[list[int]]  # generated ids per sequence (through the first stop token)
    ttft_ms: float  # this rank: start to the first token of every sequence (prefill + sampling)
    e2e_ms: float  # this rank: start to the last token
    decode_steps: int  # decode steps run (max_tokens - 1)
    breakdown: Breakdown = field(default_factory=Breakdown)  # per-op decode time (empty when timers are off)
    # GPU steps the host could not enqueue ahead of the device: their intervals include launch gaps
    breakdown_uncovered: Breakdown = field(default_factory=Breakdown)
    logits: torch.Tensor | None = None  # [steps, B, vocab] float32 on CPU, only with keep_logits=True


def split_batch(batch: int, micro_batches: int) -> list[tuple[int, int]]:
    """(first sequence, size) of each micro-batch: contiguous, sizes differing by at most one."""
    if not 1 <= micro_batches <= batch:
        raise GenerationError(f"micro_batches={micro_batches} must be between 1 and the batch size {batch}")
    base, extra = divmod(batch, micro_batches)
    out, start = [], 0
    for m in range(micro_batches):
        size = base + (1 if m < extra else 0)
        out.append((start, size))
        start += size
    return out


def build_token_groups(groups: ParallelGroups) -> dist.ProcessGroup | None:
    """The return path of sampled tokens: one group {first-stage rank i, last-stage rank i} per TP rank i.
    Collective (every rank creates every group). None when pp == 1."""
    dims = groups.dims
    if dims.pp == 1:
        return None
    mine = None
    for i in range(dims.tp):
        g = dist.new_group([dims.rank_of(0, i), dims.rank_of(dims.pp - 1, i)])
        if i == groups.tp_rank:
            mine = g
    return mine


class _MicroBatch:
    """Host plan of one micro-batch: its sequences' prompts, block tables and positions."""

    def __init__(self, prompts: list[list[int]], first_block: int, blocks_each: int, block_size: int) -> None:
        self.prompts = prompts
        self.lengths = np.asarray([len(p) for p in prompts], dtype=np.int64)
        b = len(prompts)
        self.tables = (first_block + np.arange(b * blocks_each, dtype=np.int32)).reshape(b, blocks_each)
        self.block_size = block_size

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return self.tables[rows, positions // bs].astype(np.int64) * bs + positions % bs

    def prefill_steps(self, budget: int) -> list[tuple[StepInputs, list[int]]]:
        """The prompts as chunks packed into steps of at most `budget` tokens; with each step, the sequence that
        each of its logits rows belongs to (the chunks that end a prompt sample)."""
        steps, entries, used = [], [], 0
        for i, p in enumerate(self.prompts):
            start = 0
            while start < len(p):
                n = min(len(p) - start, budget - used)
                entries.append((i, start, n))
                used += n
                start += n
                if used == budget:
                    steps.append(self._prefill(entries))
                    entries, used = [], 0
        if entries:
            steps.append(self._prefill(entries))
        return steps

    def _prefill(self, entries: list[tuple[int, int, int]]) -> tuple[StepInputs, list[int]]:
        ids, pos, slots, rows, out_rows = [], [], [], [], []
        row = 0
        for i, start, n in entries:
            p = np.arange(start, start + n, dtype=np.int64)
            ids.append(np.asarray(self.prompts[i][start : start + n], dtype=np.int64))
            pos.append(p)
            slots.append(self.slots(np.full(n, i), p))
            row += n
            if start + n == len(self.prompts[i]):
                rows.append(row - 1)
                out_rows.append(i)
        seqs = [i for i, _, _ in entries]
        x = StepInputs(
            np.concatenate(ids),
            np.concatenate(pos),
            np.concatenate(slots),
            0,
            np.asarray([s + n for _, s, n in entries], dtype=np.int32),
            np.asarray([n for _, _, n in entries], dtype=np.int32),
            self.tables[seqs],
            np.asarray(rows, dtype=np.int64),
        )
        return x, out_rows

    def decode(self, step: int) -> StepInputs:
        """Decode step `step` (1-based): each sequence's token sampled at step - 1 goes to position len + step - 1;
        its id is taken on the device from that step's sampled tokens (row i of them)."""
        b = len(self.prompts)
        rows = np.arange(b, dtype=np.int64)
        p = self.lengths + step - 1
        x = StepInputs(
            np.zeros(b, dtype=np.int64),
            p,
            self.slots(rows, p),
            b,
            (p + 1).astype(np.int32),
            np.ones(b, dtype=np.int32),
            self.tables,
            rows,
        )
        x.prev_rows, x.prev_src = rows, rows
        return x


class FixedBatchExecutor:
    def __init__(
        self,
        runner: ModelRunner,
        groups: ParallelGroups,
        sampler: BatchSampler,
        timers: Timers,
        token_group: dist.ProcessGroup | None,
        max_num_batched_tokens: int,
    ) -> None:
        self.runner, self.groups, self.sampler, self.timers = runner, groups, sampler, timers
        self.token_group = token_group
        self.budget = max_num_batched_tokens
        self.device = runner.device
        self._pending: list[dist.Work] = []

    # --- point-to-point -----------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
        with self.timers.region("pipeline"):
            # a copy: the tensor may be a graph's static buffer or a view the next step overwrites
            self._pending.append(dist.isend(t.contiguous().clone(), dst, group=group))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, group) -> torch.Tensor:
        with self.timers.region("idle"):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            dist.irecv(buf, src, group=group).wait()
            return buf

    def _complete_sends(self) -> None:
        for w in self._pending:
            w.wait()
        self._pending.clear()

    def _stage(self, x: StepInputs, prev_tokens: torch.Tensor | None):
        """This stage's part of step x: receive the previous stage's activations (not on the first stage), run,
        send ours on (not on the last). Returns the logits on the last stage, else None."""
        g, runner = self.groups, self.runner
        hidden = None
        if not g.is_first_stage:  # hidden state and residual in one message: [2, N, hidden]
            both = self._recv((2, x.num_tokens, runner.model.config.hidden_size), runner.dtype, g.prev_rank, None)
            hidden = (both[0], both[1])
        out = runner.execute(x, prev_tokens, hidden)
        if g.is_last_stage:
            return out
        self._send(torch.stack(out), g.next_rank, None)
        return None

    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        b = logits.shape[0]
        if params.greedy:
            return logits.argmax(dim=-1)
        return self.sampler.sample(logits, [params] * b, [()] * b, [None] * b).tokens

    # --- the loop -----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        micro_batches: int,
        stop_ids: tuple[int, ...],
        keep_logits: bool = False,
    ) -> GenerationOutput:
        """Generate for every prompt. keep_logits (tests, debugging) records the logits each token was sampled
        from; it costs a device copy per step and is off in benchmarks."""
        g, runner = self.groups, self.runner
        batch, steps = len(prompts), params.max_tokens
        if any(len(p) == 0 for p in prompts):
            raise GenerationError("every prompt needs at least one token")
        bs = runner.block_size
        longest = max(len(p) for p in prompts) + steps
        if longest > runner.max_blocks * bs:
            raise GenerationError(
                f"longest prompt + max_tokens = {longest} tokens exceeds max_model_len "
                f"({runner.max_blocks * bs}); raise EngineConfig.max_model_len or shorten the request"
            )
        blocks_each = -(-longest // bs)
        if 1 + batch * blocks_each > runner.cache.num_blocks:
            raise GenerationError(
                f"{batch} sequences of up to {longest} tokens need {batch * blocks_each} KV blocks of {bs} tokens; "
                f"the cache holds {runner.cache.num_blocks - 1}: give it more memory (gpu_memory_utilization, "
                "cpu_kv_cache_bytes), or run fewer or shorter sequences"
            )
        chunks = split_batch(batch, micro_batches)
        mbs = [_MicroBatch(prompts[s0 : s0 + b], 1 + s0 * blocks_each, blocks_each, bs) for s0, b in chunks]
        first, last, pp = g.is_first_stage, g.is_last_stage, g.dims.pp
        out = torch.zeros(batch, steps, dtype=torch.int64, device=self.device)  # valid on the first and last stage
        vocab = runner.model.config.vocab_size
        kept = torch.zeros(steps, batch, vocab, device=self.device) if keep_logits and last else None
        clock = WallClock(self.device)
        self.timers.reset()
        if dist.is_initialized():
            dist.barrier()
        clock.start()

        # Prefill: micro-batch m enters stage s after stage s-1 is done with it.
        for (s0, b), mb in zip(chunks, mbs):
            for x, sampled in mb.prefill_steps(self.budget):
                logits = self._stage(x, None)
                if last and sampled:
                    rows = [s0 + i for i in sampled]
                    if kept is not None:
                        kept[0, rows] = logits
                    out[rows, 0] = self._sample(logits, params)
            if last and pp > 1:
                self._send(out[s0 : s0 + b, 0], g.first_stage_peer, self.token_group)
        self._complete_sends()
        if pp > 1 and first:
            # The first tokens come from the last stage's prefill: receiving them ends this stage's prefill (its
            # TTFT). Received here, not in decode step 1, so that step's timers do not count the later stages'
            # prefill as decode idle time.
            for s0, b in chunks:
                out[s0 : s0 + b, 0] = self._recv((b,), torch.int64, g.last_stage_peer, self.token_group)
        ttft_ms = clock.now_ms()

        for step in range(1, steps):
            self.timers.step_begin()
            for (s0, b), mb in zip(chunks, mbs):
                prev = None
                if first:
                    if pp > 1 and step > 1:  # step 0's tokens (the prefill's) were received before the loop
                        out[s0 : s0 + b, step - 1] = self._recv((b,), torch.int64, g.last_stage_peer, self.token_group)
                    prev = out[s0 : s0 + b, step - 1]
                logits = self._stage(mb.decode(step), prev)
                if last:
                    if kept is not None:
                        kept[step, s0 : s0 + b] = logits
                    out[s0 : s0 + b, step] = self._sample(logits, params)
                    if pp > 1 and step < steps - 1:
                        self._send(out[s0 : s0 + b, step], g.first_stage_peer, self.token_group)
            self.timers.step_end()
        self._complete_sends()
        e2e_ms = clock.now_ms()

        # Every rank returns the same tokens: the last stage's, broadcast once, outside the timed region.
        if pp > 1:
            src = g.dims.rank_of(pp - 1, 0)
            dist.broadcast(out, src=src)
            if keep_logits:
                kept = kept if kept is not None else torch.zeros(steps, batch, vocab, device=self.device)
                dist.broadcast(kept, src=src)
        rows = out.tolist()  # the one device->host copy of the tokens
        token_ids = [_truncate_at_stop(r, stop_ids, params.ignore_eos) for r in rows]
        return GenerationOutput(
            token_ids,
            ttft_ms,
            e2e_ms,
            steps - 1,
            self.timers.breakdown,
            self.timers.uncovered,
            None if kept is None else kept.cpu(),
        )


def _truncate_at_stop(row: list[int], stop_ids: tuple[int, ...], ignore_eos: bool) -> list[int]:
    if ignore_eos:
        return row
    for i, t in enumerate(row):
        if t in stop_ids:
            return row[: i + 1]
    return row
