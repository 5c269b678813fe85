"""EngineCore: the serving engine's loop. One `step()`: schedule -> run -> sample -> append / finish.

Requests come in through `add_request` (validated there: nothing that cannot run is admitted) and
leave as `RequestOutput`s: every step reports the requests that got a token or finished. An admitted
request always ends, with a finish reason: stop (EOS, stop id, stop string), length (max_tokens) or
abort (`abort_request`, shutdown).

Tensor parallelism: rank 0 owns the scheduler. Each step it sends the plan (`StepInputs`, host arrays) to
the other TP ranks over a gloo group (`broadcast_object_list`); every rank runs the same forward; only rank
0 samples (and keeps what sampling needs: the penalties' token counts, the logprobs), and the sampled tokens
reach the other ranks as input ids in the next plan. The other ranks run `worker_loop()` until rank 0 sends
the shutdown plan. No rank but 0 schedules. An idle server's rank 0 sends an empty plan now and then
(`heartbeat`), so the workers' wait stays shorter than the collective timeout.

Async scheduling (TP = 1, on by default on a GPU): the host never waits for the step it just launched.
`step()` plans and launches step t+1 while step t's sampled tokens are still on their way: the tokens stay
on the device, the plan of t+1 takes their ids from there (`StepInputs.prev_rows`), and the host reads step
t's tokens (a pinned copy, its own event; the logprobs of the rows that ask are copied with them and covered
by the same event) only after t+1 is queued, then appends them, checks stops and reports them. So the GPU
always has the next step queued while the host schedules, detokenizes and streams. What it costs: a request
that ends on EOS or a stop (not on its length: the scheduler knows those) runs one step more than it needed,
whose token is dropped; its blocks are freed at once (that step's cache write lands before any later step,
in stream order, so a block handed to a new request is written by it afterwards). With prefix caching its full
blocks stay findable: they hold only positions of launched steps (that last step's included, its input token
being the one that ended the request), and a request that hits them is planned later, so its step reads them
after those writes, in the same order. Outputs arrive one step later than they are computed.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from spanllm.engine.core.block_manager import BlockManager
from spanllm.engine.core.scheduler import Scheduler, SchedulerConfig
from spanllm.engine.core.sequence import FinishReason, Sequence
from spanllm.engine.sampler import BatchSampler, Logprobs, SamplingParams, TokenLogprob
from spanllm.engine.worker.model_runner import ModelRunner, StepInputs, plan_step
from spanllm.errors import UsageError


class RequestError(UsageError):
    """A request the engine refuses at admission (a ValueError; the server answers 400 with its message)."""


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # everything generated so far
    new_ids: list[int]  # generated in this step
    text: str | None  # output text so far (text requests; stop strings removed)
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    metrics: dict = field(default_factory=dict)  # arrival, first_scheduled, first_token, token_times, finished_at
    # Requests that asked for logprobs (SamplingParams.logprobs), else None: one TokenLogprob per id of new_ids,
    # and of output_ids (all so far: the engine's own list, as output_ids).
    new_logprobs: list[TokenLogprob] | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # finish_reason "error": handling this request's data failed (the others go on)

    # LLM.generate's output for a prompt with SamplingParams.n > 1: every sample's own RequestOutput, in order (the
    # fields above are sample 0's); None for one sample, and in the engine's step outputs (one per engine request)
    samples: list[RequestOutput] | None = None

    # vLLM's names for the same values, for code written against vllm.RequestOutput: `out.outputs[i].text`,
    # `out.prompt_token_ids`
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompt_ids

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [
            CompletionOutput(i, s.text, s.output_ids, s.finish_reason, s.stop_reason, s.logprobs, s.finished)
            for i, s in enumerate(self.samples or [self])
        ]


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's CompletionOutput fields of a RequestOutput (RequestOutput.outputs)."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprob] | None
    finished: bool


@dataclass
class _InFlight:
    """A step whose sampled tokens the host has not read yet (async scheduling)."""

    seqs: list[Sequence]  # the sequences that sampled, in row order
    tokens: torch.Tensor  # [R] int64 on the device: the next plan's decode inputs read it
    host: torch.Tensor  # [>= R] int64 (pinned on a GPU): its copy, valid once `ready` fired
    ready: object  # torch.cuda.Event, or None on CPU (the copy is done when it returns)
    logprobs: Logprobs | None = None  # the rows that asked: host copies, valid once `ready` fired


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests, each counted once (recomputation is not)
    generation_tokens: int = 0
    preemptions: int = 0
    # Prefix cache (vLLM's prefix_cache_queries / _hits): prompt tokens of admitted requests, and of them the
    # tokens found in the cache, counted at each request's first admission. Hit rate = hits / queries.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished: dict = field(default_factory=dict)  # reason -> count


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        blocks: BlockManager,
        config: SchedulerConfig,
        *,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        tokenizer=None,
        seed: int = 0,
        control_group: dist.ProcessGroup | None = None,
        rank: int = 0,
        tp_size: int = 1,
        async_scheduling: bool | None = None,
    ) -> None:
        self.runner = runner
        self.blocks = blocks
        self.config = config
        self.scheduler = Scheduler(config, blocks)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        if async_scheduling is None:  # default: on a GPU at TP = 1 (TP ranks take token ids from the plan)
            async_scheduling = runner.device.type == "cuda" and tp_size == 1
        if async_scheduling and tp_size > 1:
            raise ValueError(
                f"async_scheduling needs tp=1 (the other TP ranks read token ids from the host plan); "
                f"this engine has tp={tp_size}"
            )
        self.async_scheduling = async_scheduling
        self.sampler = BatchSampler(runner.device, seed, to_device=runner.staging.tensor)
        self.control_group = control_group
        self.rank, self.tp_size = rank, tp_size
        self.stats = EngineStats()
        self._requests: dict[str, Sequence] = {}
        self._detok: dict[str, object] = {}
        self._logprobs: dict[str, list[TokenLogprob]] = {}  # requests that asked for logprobs: all so far
        self._counter = 0
        self._inflight: _InFlight | None = None
        self._failed: list[RequestOutput] = []  # requests ended by an error in their own data (_fail_request)
        pin = runner.device.type == "cuda"
        n = config.max_num_seqs
        self._host_tokens = [torch.empty(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host_turn = 0

    # --- admission ------------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError naming the value, the limit and the fix."""
        validate_request(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.config.max_model_len,
            capacity_tokens=self.blocks.capacity_tokens,
            eos_token_ids=self.eos_token_ids,
        )

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival: float | None = None,
        with_text: bool = False,
    ) -> Sequence:
        if self.rank != 0:
            raise RuntimeError("only TP rank 0 schedules; other ranks run worker_loop()")
        if params.stop and (self.tokenizer is None or not with_text):
            raise RequestError("stop strings need text output (a tokenizer); use stop_token_ids for token prompts")
        prompt_ids = token_ids(prompt_ids)
        self.validate(prompt_ids, params)
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already running")
        seq = Sequence(request_id, list(prompt_ids), params)
        if arrival is not None:
            seq.arrival = arrival
        self._requests[request_id] = seq
        if with_text and self.tokenizer is not None:
            self._detok[request_id] = self.tokenizer.detokenizer(seq.prompt_ids)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        return self._finish_output(seq, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, launch and sample one step; return the outputs of the step whose tokens the host read
        (this one; with async scheduling the one before, while this one runs)."""
        batch = self.scheduler.schedule()
        if batch.preempted:  # the scheduler counts them; the stats mirror its count
            self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.prefix_cache_queries = self.scheduler.prefix_cache_queries
        self.stats.prefix_cache_hits = self.scheduler.prefix_cache_hits
        prev = self._inflight  # stays self._inflight until it lands: a failed launch below does not lose it
        new = None
        if batch:
            x = plan_step(batch.entries, batch.num_decode, self.blocks.block_size)
            self._broadcast(x)
            logits = self.runner.execute(x, prev.tokens if prev is not None else None)
            self.stats.steps += 1
            sampling = [seq for seq, n in batch.entries if seq.num_computed + n == seq.num_tokens]
            if sampling:  # before num_computed moves: if sampling fails, the step can simply run again
                new = self._sample(logits, sampling)
            for seq, n in batch.entries:
                if seq.num_computed == seq.num_cached_tokens and seq.num_preemptions == 0:
                    self.stats.prompt_tokens += seq.num_prompt  # counted once, at its first chunk (cached included)
                seq.num_computed += n
        if not self.async_scheduling:
            outs = self._land_or_abort(new) if new is not None else []
        else:
            self._inflight = new  # read at the next step, after that one is queued
            outs = self._land_or_abort(prev) if prev is not None else []
        failed, self._failed = self._failed, []
        return failed + outs

    def _land_or_abort(self, f: _InFlight) -> list[RequestOutput]:
        """_land; if that fails part-way (a detokenizer error, say), its tokens cannot be landed again: the
        requests it carried end as aborted, so none is left waiting for a token that never comes."""
        try:
            return self._land(f)
        except BaseException:
            for seq in f.seqs:
                if not seq.is_finished:
                    self.abort_request(seq.request_id)
            raise

    def _land(self, f: _InFlight) -> list[RequestOutput]:
        """The host reads a step's sampled tokens (waiting for that step only), appends them and reports."""
        if f.ready is not None:
            f.ready.synchronize()
        tokens = f.host[: len(f.seqs)].tolist()
        logprobs = f.logprobs.token_logprobs(tokens) if f.logprobs is not None else [None] * len(tokens)
        now = time.monotonic()
        outs = []
        for seq, tok, lp in zip(f.seqs, tokens, logprobs):
            seq.num_pending -= 1
            if seq.is_finished:  # ended (stop, abort) after this step was launched: its token is dropped
                continue
            try:
                outs.append(self._append(seq, tok, now, lp))
            except Exception as e:  # noqa: BLE001 - this request's detokenization / stop strings: it alone ends
                self._fail_request(seq, e)
        return outs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> _InFlight | None:
        """Sample on the device, start the copies to the host (tokens, and the logprobs of the rows that ask:
        one event covers both); the tokens count as pending until they land. A request whose parameters make
        sampling raise ends with that error (_fail_request); the others sample. None when no request is left."""
        masks, gens, kept, rows = [], [], [], []
        for i, s in enumerate(seqs):
            try:
                mask, gen = self._stop_mask(s), self._generator(s)
            except Exception as e:  # noqa: BLE001 - this request's parameters: it alone ends
                self._fail_request(s, e)
                continue
            masks.append(mask)
            gens.append(gen)
            kept.append(s)
            rows.append(i)
        if len(kept) < len(seqs):
            logits = logits[rows]
        if not kept:
            return None
        try:
            tokens, logprobs = self.sampler.sample(logits, [s.params for s in kept], masks, gens, kept)
        except Exception as e:  # noqa: BLE001 - find the rows that fail alone; if every row does, the step failed
            bad = [i for i in range(len(kept)) if not self._samples_alone(logits, i, kept, masks, gens)]
            if len(bad) == len(kept):
                raise
            for i in bad:
                self._fail_request(kept[i], e)
            rows = [i for i in range(len(kept)) if i not in bad]
            kept, masks, gens = [kept[i] for i in rows], [masks[i] for i in rows], [gens[i] for i in rows]
            tokens, logprobs = self.sampler.sample(logits[rows], [s.params for s in kept], masks, gens, kept)
        seqs = kept
        for row, s in enumerate(seqs):
            s.num_pending += 1
            s.pending_row = row
        host = self._host_tokens[self._host_turn]
        self._host_turn ^= 1  # two buffers: the step being read and the one being sampled
        host[: len(seqs)].copy_(tokens, non_blocking=True)
        if logprobs is not None:
            logprobs = logprobs.to_host()
        ready = None
        if tokens.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return _InFlight(seqs, tokens, host, ready, logprobs)

    def _stop_mask(self, s: Sequence) -> tuple[int, ...]:
        """Ids to forbid in this row: EOS and stop ids before min_tokens."""
        p = s.params
        if s.num_output + s.num_pending < p.min_tokens:
            return (() if p.ignore_eos else self.eos_token_ids) + p.stop_token_ids
        return ()

    def _generator(self, s: Sequence) -> torch.Generator | None:
        p = s.params
        if p.seed is not None and not p.greedy and s.generator is None:
            g = torch.Generator(device=self.runner.device)
            g.manual_seed(p.seed)
            s.generator = g
        return s.generator

    def _samples_alone(self, logits, i, seqs, masks, gens) -> bool:
        try:
            # without the penalties (and so without request state): a probe must not move a row's token counts
            params = replace(seqs[i].params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
            self.sampler.sample(logits[i : i + 1].clone(), [params], [masks[i]], [gens[i]], None)
            return True
        except Exception:  # noqa: BLE001
            return False

    def _fail_request(self, seq: Sequence, e: BaseException) -> None:
        """Handling this request's data (its parameters, detokenization, stop strings) raised: end it now (its
        blocks freed) with the error; step() reports it and the loop serves the others."""
        out = self.abort_request(seq.request_id) if not seq.is_finished else None
        if out is None:  # it had finished already (the error came after): report it once more, as failed
            if seq.finish_reason is None:
                seq.finish(FinishReason.ABORT)
            out = self._output(seq, [], "")
            self._requests.pop(seq.request_id, None)
            self._detok.pop(seq.request_id, None)
        out.finished, out.finish_reason = True, "error"
        out.error = f"{type(e).__name__}: {e}"
        self._failed.append(out)

    def _append(self, seq: Sequence, tok: int, now: float, logprob: TokenLogprob | None = None) -> RequestOutput:
        """Append a sampled token, then decide whether the request ends (vLLM's rules):
        - before min_tokens nothing but max_tokens ends it (EOS and stop ids were masked when sampling, and
          stop strings are not looked for);
        - a stop id, or EOS unless ignore_eos, ends it; neither leaves text (the token id stays in the ids);
        - a stop string ends it at the string's start: text and the streamed deltas stop before it. So that a
          stream never shows a prefix of a stop string that later completes, the last len(longest stop) - 1
          characters are held back until the request ends or the text moves past them."""
        seq.output_ids.append(tok)
        if seq.params.logprobs is not None:
            self._logprobs.setdefault(seq.request_id, []).append(logprob)
        seq.token_times.append(now)
        if seq.first_token is None:
            seq.first_token = now
        self.stats.generation_tokens += 1
        p = seq.params
        checks = seq.num_output >= p.min_tokens
        is_stop_id = tok in p.stop_token_ids
        is_eos = tok in self.eos_token_ids and not p.ignore_eos
        finish, stop_reason = None, None
        detok = self._detok.get(seq.request_id)
        if detok is not None:
            piece = detok.push(tok)
            # an ending id's text is left out (EOS always; a stop id unless include_stop_str_in_output)
            if not (checks and (is_eos or (is_stop_id and not p.include_stop_str_in_output))):
                seq.text += piece
                if p.stop and checks:
                    hit = _find_stop(seq.text, len(piece), p.stop)
                    if hit is not None:
                        cut, s = hit
                        seq.text = seq.text[: cut + len(s) if p.include_stop_str_in_output else cut]
                        finish, stop_reason = FinishReason.STOP, s
        if finish is None and checks:
            if is_stop_id:
                finish, stop_reason = FinishReason.STOP, tok
            elif is_eos:
                finish = FinishReason.STOP
        if finish is None and seq.num_output >= p.max_tokens:
            finish = FinishReason.LENGTH
        new_text = ""
        if detok is not None:
            hold = 0 if finish is not None or not p.stop else max(len(x) for x in p.stop) - 1
            upto = max(seq.text_emitted, len(seq.text) - hold)
            new_text = seq.text[seq.text_emitted : upto]
            seq.text_emitted = upto
        new_logprobs = [logprob] if seq.params.logprobs is not None else None
        if finish is None:
            return self._output(seq, [tok], new_text, new_logprobs)
        self.scheduler.finish(seq)
        seq.finish(finish, stop_reason)
        return self._finish_output(seq, [tok], new_text, new_logprobs)

    def _output(
        self, seq: Sequence, new_ids: list[int], new_text: str, new_logprobs: list[TokenLogprob] | None = None
    ) -> RequestOutput:
        text = seq.text if seq.request_id in self._detok else None
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = self._logprobs.get(seq.request_id, [])
            new_logprobs = new_logprobs or []
        # output_ids and logprobs are the engine's own lists (no copy per step): read them, do not change them.
        return RequestOutput(
            seq.request_id,
            seq.prompt_ids,
            seq.output_ids,
            new_ids,
            text,
            new_text,
            seq.is_finished,
            seq.finish_reason.value if seq.finish_reason else None,
            seq.stop_reason,
            _metrics(seq) if seq.is_finished else {},
            new_logprobs,
            logprobs,
        )

    def _finish_output(
        self, seq: Sequence, new_ids: list[int], new_text: str, new_logprobs: list[TokenLogprob] | None = None
    ) -> RequestOutput:
        out = self._output(seq, new_ids, new_text, new_logprobs)
        self._requests.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)
        self._logprobs.pop(seq.request_id, None)
        self.sampler.release(seq.request_id)
        reason = seq.finish_reason.value
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        return out

    # --- TP control plane -------------------------------------------------------------------------------
    def _broadcast(self, x: StepInputs) -> StepInputs:
        if self.tp_size == 1:
            return x
        box = [x if self.rank == 0 else None]
        dist.broadcast_object_list(
            box,
            src=dist.get_global_rank(self.control_group, 0) if self.control_group is not None else 0,
            group=self.control_group,
        )
        return box[0]

    def worker_loop(self) -> int:
        """TP ranks other than 0: run every plan rank 0 sends until the shutdown plan. Returns steps run."""
        steps = 0
        while True:
            x = self._broadcast(None)
            if x.stop:
                return steps
            if x.noop:
                continue
            self.runner.execute(x)
            steps += 1

    def heartbeat(self) -> None:
        """Rank 0, idle: send the other ranks an empty plan, so their wait for the next step (a collective)
        never runs into the collective timeout while no request comes; a rank that died is noticed here."""
        if self.rank == 0 and self.tp_size > 1:
            self._broadcast(StepInputs.heartbeat())

    def shutdown_workers(self) -> None:
        """Rank 0: release the other ranks' worker loops (abort everything first)."""
        if self.rank == 0 and self.tp_size > 1:
            self._broadcast(StepInputs.shutdown())


def validate_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    capacity_tokens: int,
    eos_token_ids: tuple[int, ...] = (),
) -> None:
    """The admission checks, on the engine's fixed limits only (a front end in another process runs them too).
    Raises RequestError naming the value, the limit and the fix. eos_token_ids: the model's, masked with the stop
    ids before min_tokens."""
    if not prompt_ids:
        raise RequestError("the prompt is empty: give at least one token")
    if params.n != 1:
        raise RequestError(
            f"n={params.n}: an engine request is one sample; LLM.generate and the server serve n samples as n "
            "requests (give each n=1)"
        )
    total = len(prompt_ids) + params.max_tokens  # the lengths first: O(1), before the O(prompt) id checks below
    # the tighter of the two limits names itself: a pool smaller than max_model_len is what the request meets
    if total > max_model_len and max_model_len <= capacity_tokens:
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} for the "
            "completion). Reduce the prompt or max_tokens"
        )
    if total > capacity_tokens:
        raise RequestError(
            f"the request needs up to {total} tokens of KV cache but the whole pool holds "
            f"{capacity_tokens}; it could never run. Reduce the prompt or max_tokens, or give the cache "
            "more memory"
        )
    for i, t in enumerate(prompt_ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise RequestError(
                f"prompt token {i} is {t!r} ({type(t).__name__}), not a token id: give the prompt as Python ints"
            )
        if not 0 <= t < vocab_size:
            raise RequestError(
                f"prompt token {i} is {t!r}, outside the vocabulary [0, {vocab_size}); "
                f"use ids from 0 to {vocab_size - 1}"
            )
    for t in params.stop_token_ids:
        if t >= vocab_size:
            raise RequestError(f"stop_token_ids holds {t}, outside the vocabulary [0, {vocab_size})")
    eos = () if params.ignore_eos else tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
    if params.min_tokens and len(set(params.stop_token_ids) | set(eos)) >= vocab_size:
        raise RequestError(
            f"stop_token_ids{' with the EOS ids' if eos else ''} cover all {vocab_size} tokens of the vocabulary and "
            f"min_tokens={params.min_tokens} forbids them until then: no token could be sampled; drop min_tokens or "
            "some stop ids"
        )
    for t, _ in params.logit_bias:
        if t >= vocab_size:
            raise RequestError(f"logit_bias names token {t}, outside the vocabulary [0, {vocab_size})")
    if params.top_k > vocab_size:
        raise RequestError(
            f"top_k={params.top_k} exceeds the vocabulary of {vocab_size} tokens; use at most {vocab_size}, or 0 (off)"
        )


def token_ids(prompt) -> list:
    """The prompt as a list of Python ints where its ids are integers of any kind (numpy, a torch tensor's
    elements); anything else is kept as it is, for validate_request to name."""
    if prompt is None:
        return prompt
    out = []
    for t in prompt:
        try:
            out.append(t if isinstance(t, int) else operator.index(t))  # bools stay bools (an int subclass)
        except TypeError:
            out.append(t)
    return out


def _find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last new_len characters: (where it starts, which)."""
    best = None
    for s in stops:
        lo = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, lo)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _metrics(seq: Sequence) -> dict:
    return {
        "arrival": seq.arrival,
        "first_scheduled": seq.first_scheduled,
        "first_token": seq.first_token,
        "token_times": list(seq.token_times),
        "finished_at": seq.finished_at,
        "num_preemptions": seq.num_preemptions,
    }
