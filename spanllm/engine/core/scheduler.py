"""Scheduler: which sequences run in the next step, and how many of their tokens.

Policy (decode-first with chunked prefill, as vLLM V1 and Sarathi-Serve; FCFS):
1. Every running sequence that is decoding (one token to run) is scheduled first, oldest first. If its
   next token needs a block and none is free, the newest running sequence that is not yet scheduled
   is preempted by recompute (blocks freed, put back at the head of the waiting queue, its output
   kept), until a block frees up or the sequence itself is the newest (then it is preempted).
   Decodes are never starved by prefills: they take the budget before any prompt does.
2. Running sequences in the middle of a chunked prefill get the rest of the token budget, oldest
   first: a chunk of at most the budget left. If the oldest of them has no block for its next chunk, the newest
   running sequences not scheduled in this step (newer prompts part-way through theirs) are preempted until it
   has one: two half-prefilled prompts can otherwise hold the whole pool and neither ever finishes.
3. Waiting sequences are admitted in arrival order while the budget, `max_num_seqs` and free blocks
   allow. The first that does not fit stops admission (strict FCFS: nothing behind it skips ahead).
   Admission never preempts, and a step that preempted admits nothing.
   With `scheduling_policy="prefix"` the order groups requests by prompt prefix (SGLang's longest-prefix-match
   scheduling, bounded so that no request waits forever): a request's family is the key of its first
   PREFIX_FAMILY_BLOCKS full blocks (the prefix cache's chained block hash, so equal keys are equal prefixes).
   Families whose prefix is cached at the start of the step are admitted first, whole (oldest member first), in
   the order of their oldest waiting member; then the other requests in arrival order. A family whose prefix a
   step admits uncached waits until that member's whole prompt is computed and registered (admitting the others
   earlier would compute the same prefix again, in parallel; the family key covers only the first blocks of a
   shared part that may be longer), and is then a cached family. Decodes of one family thus run in
   the same steps, as wide groups, which the shared-prefix decode attention reads once per group
   (spanllm.attention.shared_prefix). Bound: once the oldest waiting request has been overtaken by
   `max_num_seqs` admissions, it is admitted before any cached family (then its family follows when cached).

Long prefills beside decodes: a prefill chunk's attention costs (chunk) x (keys before it + chunk / 2) query-key
pairs, so at 100k tokens of context one 8,192-token chunk takes most of a second, and every decode in that step
waits for it. When a step has decodes, its prefill chunks together get at most `long_prefill_attention_budget`
pairs (0: no limit); the first prefill of a step always gets at least one token, so a prompt always progresses.
A step without decodes (an idle engine) keeps the whole token budget: its TTFT is unchanged. Short contexts are
not affected (8,192 tokens at 4k of context are 4e7 pairs, under the default 2^26). Where a step's time is the
prefill's tokens rather than its attention (a CPU: an 8,000-token prompt is minutes of linear layers), the prefill
chunks of a step with decodes also take at most `prefill_tokens_beside_decodes` tokens together (0: no limit),
and every prefill chunk, in any step, takes at most `long_prefill_token_threshold` tokens of one prompt (vLLM's
setting of that name; 0: no limit): a long prompt then runs in steps of a few seconds, each of which can admit the
requests that arrived meanwhile beside it, where one step of its whole prompt would hold the engine loop (new
arrivals, aborts, the health check's progress) for minutes.

Prefix caching: an admitted sequence first takes the longest run of cached full blocks its tokens start
with (BlockManager.lookup: never its last token, so a fully cached prompt still runs one token to sample
from), and only the rest counts in the step's budget and needs new blocks. The blocks a step's prefill
chunks filled are registered at the start of the next schedule (their K/V were written by a launched step).
Queries and hits (tokens) are counted at a request's first admission, as vLLM's prefix-cache stats.

A scheduled prefill chunk that reaches the end of what a sequence has (prompt, plus output after a
preemption) samples its next token in that step; a shorter chunk samples nothing.

Invariants: every step's tokens <= max_num_batched_tokens and sequences <= max_num_seqs; a sequence
appears once per step; the KV of positions [0, num_computed + n) has blocks before the step runs.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from spanllm.engine.core.block_manager import BlockManager
from spanllm.engine.core.sequence import FinishReason, Sequence, SequenceStatus

DEFAULT_LONG_PREFILL_ATTENTION_BUDGET = 1 << 26  # pairs: ~35 TFLOP of attention in the 8B, ~0.1 s on an H100
SCHEDULING_POLICIES = ("fcfs", "prefix")
# The prefix that makes a family under scheduling_policy="prefix": 32 blocks (512 tokens at block size 16, the
# shared-prefix decode attention's least group prefix); a shorter prompt belongs to none.
PREFIX_FAMILY_BLOCKS = 32


def chunk_within_pairs(context: int, pairs: int) -> int:
    """The most tokens n of a prefill chunk after `context` computed tokens whose causal attention,
    n * context + n * (n + 1) / 2 query-key pairs, stays within `pairs` (0 if not even one token)."""
    b = 2 * context + 1
    return (math.isqrt(b * b + 8 * pairs) - b) // 2  # the root of n^2 + b n - 2 pairs, rounded down


def chunk_pairs(context: int, n: int) -> int:
    return n * context + n * (n + 1) // 2


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    # Admission batching (off at 1): while decodes run, wait until this many sequence slots are free (or as
    # many as are waiting) before admitting, so new prompts arrive in fewer, larger prefill steps and more
    # steps are pure decode (CUDA-graph replays). A request never waits more than admit_max_wait_steps steps.
    min_admit: int = 1
    admit_max_wait_steps: int = 16
    # Query-key pairs the prefill chunks of a step with decodes may attend (module docstring); 0 = no limit.
    long_prefill_attention_budget: int = DEFAULT_LONG_PREFILL_ATTENTION_BUDGET
    # Admission order (module docstring): "fcfs", or "prefix" (families of requests sharing a prompt prefix
    # admitted together; needs prefix caching)
    scheduling_policy: str = "fcfs"
    # Tokens the prefill chunks of a step with decodes may take together (module docstring); 0 = no limit but
    # max_num_batched_tokens.
    prefill_tokens_beside_decodes: int = 0
    # Tokens one prompt's prefill chunk may take in any step (module docstring); 0 = no limit.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "min_admit", "admit_max_wait_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        v = self.long_prefill_attention_budget
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"long_prefill_attention_budget={v!r} must be an integer >= 0 (0: no limit)")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be one of {SCHEDULING_POLICIES}")
        for name in ("prefill_tokens_beside_decodes", "long_prefill_token_threshold"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}={v!r} must be an integer >= 0 (0: no limit)")


@dataclass
class ScheduledBatch:
    """One step's work: (sequence, tokens to run), decodes first. `num_decode` entries run one token."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    num_decode: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        if config.scheduling_policy == "prefix" and not blocks.enable_prefix_caching:
            raise ValueError(
                "scheduling_policy='prefix' admits requests that share a cached prompt prefix together; it needs "
                "prefix caching on (enable_prefix_caching=True), or use scheduling_policy='fcfs'"
            )
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        # scheduling_policy="prefix": the waiting requests of each family (family key -> arrival order; the same
        # sequences as in self.waiting, kept in step with it)
        self.families: dict[bytes, deque[Sequence]] = {}
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens of first admissions
        self.prefix_cache_hits = 0  # of them, taken from the prefix cache
        self._held_steps = 0  # steps admission has been held back by min_admit
        # scheduling_policy="prefix": queue_key counters (arrivals count up from 1, preempted ones down from -1:
        # the order of self.waiting), and the admissions that overtook the current head of the queue
        self._next_arrival_key, self._next_preempted_key = 1, -1
        self._head: Sequence | None = None
        self._head_overtaken = 0
        # families whose prefix a running sequence is computing (admitted uncached): their other members wait
        # until its whole prompt is computed and registered (the family key covers only the prompt's first
        # PREFIX_FAMILY_BLOCKS blocks; the shared part may be longer), however many steps its chunks take
        self._prefix_in_flight: dict[bytes, Sequence] = {}
        self._prefilled: list[Sequence] = []  # the last step's prefill chunks: their full blocks get registered

    # --- queues -------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if self.config.scheduling_policy == "prefix":
            seq.queue_key, self._next_arrival_key = self._next_arrival_key, self._next_arrival_key + 1
            seq.family = self._family_of(seq)
            if seq.family is not None:
                self.families.setdefault(seq.family, deque()).append(seq)

    def _family_of(self, seq: Sequence) -> bytes | None:
        """The key of seq's first PREFIX_FAMILY_BLOCKS full prompt blocks (None: a shorter prompt)."""
        if (seq.num_prompt - 1) // self.blocks.block_size < PREFIX_FAMILY_BLOCKS:
            return None
        return self.blocks.block_hashes(seq, PREFIX_FAMILY_BLOCKS)[PREFIX_FAMILY_BLOCKS - 1]

    def _leave_waiting(self, seq: Sequence) -> None:
        """seq leaves the waiting queue (admitted, aborted or finished), and its family's."""
        if self.waiting and self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        fam = self.families.get(seq.family) if seq.family is not None else None
        if fam is not None:
            fam.remove(seq)
            if not fam:
                del self.families[seq.family]

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request from either queue, free its blocks; None when it is not here (finished)."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    if queue is self.waiting:
                        self._leave_waiting(seq)
                    else:
                        queue.remove(seq)
                    self.blocks.free(seq)
                    seq.finish(FinishReason.ABORT)
                    return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """A sequence finished in postprocessing: leave its queue, free its blocks. Usually it is running;
        with async scheduling it may have been preempted (waiting) after the step that sampled its last token."""
        if seq.status is SequenceStatus.WAITING:
            self._leave_waiting(seq)
        else:
            self.running.remove(seq)
        self.blocks.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -----------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        for seq in self._prefilled:  # the step that wrote these blocks was launched: they may be shared now
            if seq.status is SequenceStatus.RUNNING:
                self.blocks.register(seq)
        self._prefilled = []

        # 1. decodes (one token each), preempting from the newest when blocks run out
        bs = self.blocks.block_size
        for seq in list(self.running):
            if budget == 0:
                break
            n_tok = len(seq.prompt_ids) + len(seq.output_ids) + seq.num_pending
            if seq.status is not SequenceStatus.RUNNING or n_tok - seq.num_computed != 1:
                continue
            if seq.num_pending and len(seq.output_ids) + seq.num_pending >= seq.params.max_tokens:
                continue  # its last token is in flight (async scheduling): it finishes when that one lands
            # Fast path: the new token's slot is in a block it already holds (all but one step in block_size).
            if (n_tok + bs - 1) // bs > len(seq.block_table) and not self._make_room(seq, n_tok, scheduled, out):
                continue  # seq itself was preempted
            out.entries.append((seq, 1))
            scheduled.add(id(seq))
            budget -= 1
        out.num_decode = len(out.entries)

        # 2. running sequences part-way through a chunked prefill
        # the attention budget of this step's prefill chunks; None: no limit (no decodes, or the budget is off)
        pairs_left = (self.config.long_prefill_attention_budget or None) if out.num_decode else None
        if out.num_decode and self.config.prefill_tokens_beside_decodes:
            budget = min(budget, self.config.prefill_tokens_beside_decodes)
        for seq in self.running:
            if budget == 0:
                break
            if id(seq) in scheduled or seq.num_uncomputed <= 1:
                continue
            n = self._chunk_that_fits(seq, budget)
            if n == 0 and self._preempt_newer(seq, scheduled, out):
                n = self._chunk_that_fits(seq, budget)
            n, pairs_left = self._capped(seq, n, seq.num_computed, pairs_left, out)
            if n == 0:
                break  # no blocks (or no attention budget): later prefills would not fit either (FCFS among them)
            self.blocks.grow(seq, seq.num_computed + n)
            out.entries.append((seq, n))
            self._prefilled.append(seq)
            scheduled.add(id(seq))
            budget -= n

        # 3. admit waiting sequences, in arrival order; not in a step that had to preempt (the pool is full:
        # admitting would hand the victims' blocks to a prefill, and the victim would come straight back)
        if out.preempted:
            return out
        if self.waiting and not self._admission_open(out.num_decode):
            self._held_steps += 1
            return out
        self._held_steps = 0
        # scheduling_policy="prefix": the family being admitted, the families to wait for this step's blocks, and
        # the waiting families cached at the start of admission (computed at the first admission that needs them)
        family, deferred, cached_families = None, self._families_in_flight(), None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self.config.scheduling_policy == "fcfs":
                seq = self.waiting[0]
            else:
                if cached_families is None:
                    cached_families = self._cached_families()
                seq = self._next_waiting(family, deferred, cached_families)
                if seq is None:
                    break
            hits = self.blocks.lookup(seq)
            n = self._chunk_that_fits(seq, budget, hits)
            n, pairs_left = self._capped(seq, n, len(hits) * bs, pairs_left, out)
            if n == 0:
                break
            if self.config.scheduling_policy == "prefix":
                self._head_overtaken = 0 if seq is self._head else self._head_overtaken + 1
            self._leave_waiting(seq)
            if seq.family is not None:
                # cached: its family follows it; computed now: the rest wait for its whole prompt's blocks
                family = seq.family if len(hits) >= PREFIX_FAMILY_BLOCKS else None
                if family is None:
                    deferred.add(seq.family)
                    self._prefix_in_flight[seq.family] = seq
            else:
                family = None
            if hits:
                self.blocks.take(seq, hits)
            seq.num_computed = seq.num_cached_tokens = len(hits) * bs
            if seq.num_preemptions == 0:
                self.prefix_cache_queries += seq.num_prompt
                self.prefix_cache_hits += seq.num_cached_tokens
            self.blocks.grow(seq, seq.num_computed + n)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            self.running.append(seq)
            out.entries.append((seq, n))
            self._prefilled.append(seq)
            scheduled.add(id(seq))
            budget -= n
        return out

    def _families_in_flight(self) -> set[bytes]:
        """The families whose prefix a running sequence is still computing: its prompt's blocks are registered at
        the start of the step after its last chunk's (called after that registration)."""
        flight = self._prefix_in_flight
        for key, seq in list(flight.items()):
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed >= seq.num_prompt:
                del flight[key]
        return set(flight)

    def _cached_families(self) -> deque[bytes]:
        """The waiting families whose prefix is registered in the prefix cache, by their oldest waiting member."""
        cached = self.blocks.cached
        keyed = sorted((members[0].queue_key, key) for key, members in self.families.items() if key in cached)
        return deque(key for _, key in keyed)

    def _next_waiting(self, family: bytes | None, deferred: set[bytes], cached: deque[bytes]) -> Sequence | None:
        """The next request to admit under "prefix" (module docstring): the oldest of the family being admitted;
        else the head of the queue if it has been overtaken max_num_seqs times; else the oldest of the next cached
        family; else the oldest whose family is not waiting for this step's blocks (None: every waiting one is)."""
        members = self.families.get(family) if family is not None else None
        if members:
            return members[0]
        head = self.waiting[0]
        if head is not self._head:
            self._head, self._head_overtaken = head, 0
        if self._head_overtaken >= self.config.max_num_seqs and (head.family is None or head.family not in deferred):
            return head
        while cached:
            members = self.families.get(cached[0])
            if members and cached[0] not in deferred:
                return members[0]
            cached.popleft()  # admitted whole, or found uncached (evicted) by this step: deferred
        for seq in self.waiting:
            if seq.family is None or seq.family not in deferred:
                return seq
        return None

    def _capped(self, seq: Sequence, n: int, context: int, pairs_left: int | None, out: ScheduledBatch):
        """(chunk, pairs left): n cut to the step's attention budget; the step's first prefill gets >= 1 token."""
        if pairs_left is None or n == 0:
            return n, pairs_left
        first_prefill = len(out.entries) == out.num_decode
        n = max(min(n, chunk_within_pairs(context, pairs_left)), 1 if first_prefill else 0)
        return n, max(0, pairs_left - chunk_pairs(context, n))

    def _admission_open(self, num_decode: int) -> bool:
        c = self.config
        if c.min_admit <= 1 or num_decode == 0 or self._held_steps >= c.admit_max_wait_steps:
            return True
        free = c.max_num_seqs - len(self.running)
        return free >= min(c.min_admit, len(self.waiting))

    def _chunk_that_fits(self, seq: Sequence, budget: int, hits: list[int] = ()) -> int:
        """The longest chunk of seq's uncomputed tokens within the budget whose blocks are free (0: none).
        hits: cached blocks a waiting seq would start with (computed already; taking them out of the
        evictable pool leaves fewer free blocks)."""
        cached = len(hits) * self.blocks.block_size
        n = min(seq.num_uncomputed - cached, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        free = self.blocks.num_free - (self.blocks.num_unreferenced(hits) if hits else 0)
        room = (len(seq.block_table) + len(hits) + free) * self.blocks.block_size - seq.num_computed - cached
        return max(0, min(n, room))

    def _make_room(self, seq: Sequence, num_positions: int, scheduled: set[int], out: ScheduledBatch) -> bool:
        """Free blocks for seq by preempting the newest unscheduled running sequences; False when seq
        itself had to go."""
        while not self.blocks.can_grow(seq, num_positions):
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.blocks.grow(seq, num_positions)
        return True

    def _preempt_newer(self, seq: Sequence, scheduled: set[int], out: ScheduledBatch) -> bool:
        """Free a block for the next chunk of seq (a prefill part-way through) by preempting the newest running
        sequences behind it that this step has not scheduled; False when none could go (only the step's decodes,
        which finish and free theirs, hold the rest)."""
        newer = self.running[self.running.index(seq) + 1 :]
        preempted = False
        while self._chunk_that_fits(seq, 1) == 0:
            victim = next((s for s in reversed(newer) if id(s) not in scheduled and s in self.running), None)
            if victim is None:
                break
            self._preempt(victim, out)
            preempted = True
        return preempted

    def _preempt(self, seq: Sequence, out: ScheduledBatch) -> None:
        """Preemption by recompute: the sequence keeps its tokens and prefills them all again later."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        if self.config.scheduling_policy == "prefix":
            seq.queue_key, self._next_preempted_key = self._next_preempted_key, self._next_preempted_key - 1
        if seq.family is not None:  # back at the head of its family too (its oldest)
            self.families.setdefault(seq.family, deque()).appendleft(seq)
        out.preempted.append(seq)
