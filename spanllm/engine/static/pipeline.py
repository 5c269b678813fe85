"""PipelineExecutor: the generate loop of one rank, for any pipeline depth (pp=1 is the plain loop).

The batch is cut into M micro-batches (contiguous cache slots). Each stage runs, per step, every
micro-batch in order: receive its input (token ids on the first stage, hidden states elsewhere), run
its layers, send the result on. The last stage samples and, when pp > 1, sends the new tokens back
to the first stage, which needs them as the next step's input. With M = 1 the stages take turns (the
naive schedule); with M >= pp, stage s works on micro-batch m while stage s+1 works on m-1.

Transfers are `torch.distributed` point-to-point (NCCL on GPU, gloo on CPU). Activations travel in
the world group; tokens travel back in a group of their own (one per TP rank: first and last stage),
so at pp=2, where both directions join the same two ranks, the two streams of messages never queue
behind each other. Sends are posted asynchronously and completed at the end of the phase.

pp=1 runs the device-resident loop (`ModelRunner.start_steps` / `step`): one CUDA-graph replay per
step and micro-batch holds the whole step, sampling included, and feeds the sampled token back as
the next input on the device; no per-step host sync, allocation or host->device copy.

Stopping: with pp=1 the loop ends when every sequence has produced a stop token (unless
`ignore_eos`), checked every `EngineConfig.eos_check_interval` steps (default 16, one device->host
sync per check; up to interval - 1 steps may run past the last stop, their tokens dropped, and
`decode_steps` counts the steps that ran). With pp>1 middle stages never see tokens, so the loop always
runs `max_tokens` steps and tokens after a stop token are dropped from the result (deciding
earlier would need a collective per step, which would serialize the stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spanllm.engine.sampler import Sampler, SamplingParams
from spanllm.engine.static.model_runner import ModelRunner
from spanllm.engine.timers import Breakdown, Timers, WallClock
from spanllm.model.parallel_dims import ParallelGroups


class GenerationError(ValueError):
    """A request the engine cannot run (too long, too many sequences, bad micro-batching)."""


@dataclass
class GenerationOutput:
    token_ids: list[list[int]]  # generated ids per sequence (through the first stop token)
    ttft_ms: float  # this rank: start to the first token of every sequence (prefill + sampling)
    e2e_ms: float  # this rank: start to the last token
    decode_steps: int  # decode steps run (pp=1 with stop tokens: up to eos_check_interval - 1 past the last stop)
    breakdown: Breakdown = field(default_factory=Breakdown)  # per-op decode time (empty when timers are off)
    # GPU steps the host could not enqueue ahead of the device: their intervals include launch gaps
    breakdown_uncovered: Breakdown = field(default_factory=Breakdown)
    logits: torch.Tensor | None = None  # [steps, B, vocab] float32 on CPU, only with keep_logits=True


def split_batch(batch: int, micro_batches: int) -> list[tuple[int, int]]:
    """(first slot, size) of each micro-batch: contiguous, sizes differing by at most one."""
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


class PipelineExecutor:
    def __init__(
        self,
        runner: ModelRunner,
        groups: ParallelGroups,
        sampler: Sampler,
        timers: Timers,
        token_group: dist.ProcessGroup | None,
    ) -> None:
        self.runner = runner
        self.groups = groups
        self.sampler = sampler
        self.timers = timers
        self.token_group = token_group
        self.device = runner.device
        self._pending: list[dist.Work] = []

    # --- point-to-point -----------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
        with self.timers.region("pipeline"):
            # A decode graph's output is a static buffer that the next replay overwrites: send a copy.
            self._pending.append(dist.isend(t.contiguous().clone(), dst, group=group))

    def _recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, src: int, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        with self.timers.region("idle"):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            dist.irecv(buf, src, group=group).wait()
            return buf

    def _complete_sends(self) -> None:
        for w in self._pending:
            w.wait()
        self._pending.clear()

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
        """Generate for every prompt. keep_logits (tests, debugging) records the logits each token was
        sampled from; it costs a device copy per step and is off in benchmarks."""
        g, runner = self.groups, self.runner
        engine = runner.engine
        batch = len(prompts)
        if batch > engine.max_batch_size:
            raise GenerationError(
                f"{batch} sequences exceed max_batch_size={engine.max_batch_size}; "
                "raise EngineConfig.max_batch_size or split the batch"
            )
        if any(len(p) == 0 for p in prompts):
            raise GenerationError("every prompt needs at least one token")
        lengths_host = [len(p) for p in prompts]
        steps = params.max_tokens
        if max(lengths_host) + steps - 1 > engine.max_seq_len:
            raise GenerationError(
                f"longest prompt {max(lengths_host)} + max_tokens {steps} needs {max(lengths_host) + steps - 1} "
                f"cache positions but max_seq_len={engine.max_seq_len}; raise max_seq_len or shorten the request"
            )
        chunks = split_batch(batch, micro_batches)
        dev, hidden, dtype = self.device, runner.hidden_size, engine.dtype
        width = max(lengths_host)
        ids = torch.zeros(batch, width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
        ids = ids.to(dev)
        lengths = torch.tensor(lengths_host, dtype=torch.int64, device=dev)
        out = torch.zeros(batch, steps, dtype=torch.int64, device=dev)  # valid on the first and last stage
        kept = (
            torch.zeros(steps, batch, self.runner.model.config.vocab_size, device=dev) if keep_logits else None
        )  # filled on the last stage
        prev, nxt = g.prev_rank, g.next_rank
        first, last, pp = g.is_first_stage, g.is_last_stage, g.dims.pp
        clock = WallClock(dev)
        self.timers.reset()
        if dist.is_initialized():
            dist.barrier()
        clock.start()

        # Prefill: micro-batch m enters stage s after stage s-1 is done with it.
        for s0, b in chunks:
            t_m = max(lengths_host[s0 : s0 + b])
            x = ids[s0 : s0 + b, :t_m] if first else self._recv((b, t_m, hidden), dtype, prev, None)
            y = runner.prefill(x, lengths[s0 : s0 + b], s0)
            if last:
                if kept is not None:
                    kept[0, s0 : s0 + b] = y
                out[s0 : s0 + b, 0] = self.sampler(y, params)
                if pp > 1:
                    self._send(out[s0 : s0 + b, 0], g.first_stage_peer, self.token_group)
            else:
                self._send(y, nxt, None)
        self._complete_sends()
        if pp > 1 and first:
            # The first tokens come from the last stage's prefill: receiving them ends this stage's prefill
            # (its TTFT). Received here, not in decode step 1, so that step's timers do not count the
            # later stages' prefill as decode idle time (at batch 64 that was ~1 s in an 8-step average).
            for s0, b in chunks:
                out[s0 : s0 + b, 0] = self._recv((b,), torch.int64, g.last_stage_peer, self.token_group)
        ttft_ms = clock.now_ms()

        if pp == 1:
            out, step = self._decode_whole_model(out, chunks, lengths, lengths_host, params, stop_ids, kept)
        else:
            step = self._decode_pipelined(out, chunks, lengths, lengths_host, params, kept)
        self._complete_sends()
        e2e_ms = clock.now_ms()

        # Every rank returns the same tokens: the last stage's, broadcast once, outside the timed region.
        if pp > 1:
            dist.broadcast(out, src=g.dims.rank_of(pp - 1, 0))
            if kept is not None:
                dist.broadcast(kept, src=g.dims.rank_of(pp - 1, 0))
        rows = out[:, :step].tolist()  # the one device->host copy of the tokens
        token_ids = [_truncate_at_stop(r, stop_ids, params.ignore_eos) for r in rows]
        return GenerationOutput(
            token_ids,
            ttft_ms,
            e2e_ms,
            step - 1,
            self.timers.breakdown,
            self.timers.uncovered,
            None if kept is None else kept[:step].cpu(),
        )

    def _decode_whole_model(
        self,
        out: torch.Tensor,
        chunks: list[tuple[int, int]],
        lengths: torch.Tensor,
        lengths_host: list[int],
        params: SamplingParams,
        stop_ids: tuple[int, ...],
        kept: torch.Tensor | None,
    ) -> tuple[torch.Tensor, int]:
        """pp = 1: the device-resident loop. Each step of each micro-batch is `runner.step` (one graph
        replay on GPU): the sampled token becomes the next input and lands in the bucket's history on the
        device, so the host only launches. Stop tokens are checked every `eos_check_interval` steps (one
        sync each); the tokens come to the host once, after the timed region. Returns (tokens [B, step],
        step): `step - 1` decode steps ran."""
        runner, steps = self.runner, params.max_tokens
        interval = runner.engine.eos_check_interval
        stops = (
            torch.tensor(stop_ids, dtype=torch.int64, device=self.device)
            if stop_ids and not params.ignore_eos
            else None
        )
        buckets = [
            runner.start_steps(s0, out[s0 : s0 + b, 0], lengths[s0 : s0 + b], params, self.sampler) for s0, b in chunks
        ]
        # The first token is already synced (TTFT): checking it costs no extra wait.
        done = stops is not None and _all_stopped([out[:, :1]], stops)
        step = 1
        while step < steps and not done:
            self.timers.step_begin()
            for (s0, b), st in zip(chunks, buckets):
                kv_len = max(lengths_host[s0 : s0 + b]) + step  # eager attention bound; graphs ignore it
                logits = runner.step(st, params, self.sampler, kv_len)
                if kept is not None:
                    kept[step, s0 : s0 + b] = logits
            self.timers.step_end()
            step += 1
            if stops is not None and (step - 1) % interval == 0:
                done = _all_stopped([st.history[:, :step] for st in buckets], stops)
        return torch.cat([st.history[:, :step] for st in buckets]), step

    def _decode_pipelined(
        self,
        out: torch.Tensor,
        chunks: list[tuple[int, int]],
        lengths: torch.Tensor,
        lengths_host: list[int],
        params: SamplingParams,
        kept: torch.Tensor | None,
    ) -> int:
        """pp > 1: every stage runs `max_tokens` steps, exchanging activations and tokens each step.
        Returns the step count (`step - 1` decode steps ran)."""
        g, runner, steps = self.groups, self.runner, params.max_tokens
        hidden, dtype = runner.hidden_size, runner.engine.dtype
        prev, nxt = g.prev_rank, g.next_rank
        first, last = g.is_first_stage, g.is_last_stage
        step = 1
        while step < steps:
            self.timers.step_begin()
            for s0, b in chunks:
                if not first:
                    x = self._recv((b, 1, hidden), dtype, prev, None)
                else:
                    if step > 1:  # step 0's tokens (the prefill's) were received before the loop
                        out[s0 : s0 + b, step - 1] = self._recv((b,), torch.int64, g.last_stage_peer, self.token_group)
                    x = out[s0 : s0 + b, step - 1 : step]  # [b, 1]
                positions = lengths[s0 : s0 + b] + (step - 1)  # where this step's input token goes
                kv_len = max(lengths_host[s0 : s0 + b]) + step
                y = runner.decode(x, positions, s0, kv_len)
                if last:
                    if kept is not None:
                        kept[step, s0 : s0 + b] = y
                    out[s0 : s0 + b, step] = self.sampler(y, params)
                    if step < steps - 1:
                        self._send(out[s0 : s0 + b, step], g.first_stage_peer, self.token_group)
                else:
                    self._send(y, nxt, None)
            self.timers.step_end()
            step += 1
        return step


def _all_stopped(generated: list[torch.Tensor], stops: torch.Tensor) -> bool:
    """Whether every row of every [b, n] token block holds a stop token (one host sync)."""
    flags = [torch.isin(t, stops).any(dim=1).all() for t in generated]
    return bool(torch.stack(flags).all())


def _truncate_at_stop(row: list[int], stop_ids: tuple[int, ...], ignore_eos: bool) -> list[int]:
    if ignore_eos:
        return row
    for i, t in enumerate(row):
        if t in stop_ids:
            return row[: i + 1]
    return row
