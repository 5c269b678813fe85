"""ModelRunner: turns a planned step into tensors, runs this rank's stage of the model over the paged KV cache,
and returns the logits of the rows that sample (last stage) or the hidden state and residual for the next stage.

`StepInputs` is the whole step as host arrays (numpy): the plan rank 0 sends to the other ranks, who run
`execute` on it exactly as rank 0 does. Token layout: decode tokens first (one per sequence), then prefill
chunks; `logits_rows` picks the rows that sample (every decode, and each chunk that reaches the end of its
sequence).

CUDA graphs (a whole-model runner whose attention backend supports them): one graph per padded batch size of
the bucket ladder (1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs) for decode-only steps (per variant the
backend names: with shared-prefix attention on, a second graph per bucket runs its stage), and one per padded
token count of the token ladder for mixed steps (any prefill chunk) up to MIXED_GRAPH_MAX_TOKENS, captured on
first use into one memory pool. The runner keeps the static token ids, positions and slots (padded tokens:
token 0 at position 0, slot 0 in reserved block 0, computing garbage nobody reads; every op outside attention
is row-wise) and the logits
rows; the attention backend keeps its own static metadata (spanllm.attention.triton). The all-reduces of the
row-parallel layers are captured inside. Every step on CPU, on a pipeline stage, or with graphs off runs
eagerly, and so does a step the backend asks to (`eager_only`: the cascade prefill's long chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from spanllm.attention.backend import AttentionBackend
from spanllm.attention.layer import bind_backend
from spanllm.cuda_graph import capture_graph
from spanllm.engine.worker.host_staging import HostStaging
from spanllm.engine.worker.kv_cache import PagedKVCache
from spanllm.layers.rope import RotaryEmbedding
from spanllm.model.llama import LlamaForCausalLM

# The largest mixed step a graph is captured for. A step above it (a long prompt's chunk with
# max_num_batched_tokens raised) runs eagerly: its GEMMs take a tenth of a second or more, next to which launch
# costs vanish, while every graph of such a bucket keeps its own activations in the pool (on an H100, the ladder
# up to 24,576 tokens held 23.7 GB: results/h100/long_context/README.md, call E).
MIXED_GRAPH_MAX_TOKENS = 8192


def token_ladder(max_tokens: int) -> list[int]:
    """Mixed-step buckets: 16, 32, 64, then steps of 64 to 1024, of 128 to 2048, of 512 beyond, capped at
    max_tokens. Every padded token runs through every GEMM, and a serving run's mixed steps hold a few hundred
    decodes plus a prefill chunk: fine steps there keep the padding small."""
    ladder = [16, 32, 64] + list(range(128, 1025, 64)) + list(range(1152, 2049, 128))
    b = 2560
    while b < max_tokens:
        ladder.append(b)
        b += 512
    return sorted({x for x in ladder if x < max_tokens} | {max_tokens})


def bucket_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 8 up to 256, steps of 16 beyond (vLLM's shape), capped at max_num_seqs."""
    ladder = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    b = 16
    while b < max_num_seqs:
        ladder.append(b)
        b += 8 if b < 256 else 16
    ladder.append(max_num_seqs)
    return sorted(set(ladder))


@dataclass
class StepInputs:
    """One step, as rank 0 plans it (host arrays, sent as is to the other TP ranks)."""

    token_ids: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    slots: np.ndarray  # [N] int64
    num_decode: int
    context_lens: np.ndarray  # [S] int32 per scheduled sequence (decodes first), after this step
    q_lens: np.ndarray  # [S] int32 tokens each runs this step (1 for decodes)
    block_tables: np.ndarray  # [S, W] int32
    logits_rows: np.ndarray  # [R] int64 packed-token rows whose logits are sampled
    # Async scheduling: token rows whose ids are still on the device, in the previous step's sampled tokens
    # (row prev_rows[i] of this step takes sampled[prev_src[i]]); empty when every id is on the host.
    prev_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    prev_src: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    stop: bool = False  # the worker loop ends (shutdown)
    noop: bool = False  # a heartbeat: nothing to run (keeps an idle server's workers inside the collective timeout)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @staticmethod
    def shutdown() -> StepInputs:
        return StepInputs._empty(stop=True)

    @staticmethod
    def heartbeat() -> StepInputs:
        return StepInputs._empty(noop=True)

    @staticmethod
    def _empty(**flags) -> StepInputs:
        z = np.zeros(0, dtype=np.int64)
        return StepInputs(z, z, z, 0, z.astype(np.int32), z.astype(np.int32), np.zeros((0, 1), np.int32), z, **flags)


def plan_step(entries, num_decode: int, block_size: int) -> StepInputs:
    """StepInputs from the scheduler's (sequence, tokens) entries (decodes first).

    Host cost matters here (it runs every step, for up to max_num_seqs sequences, while the GPU waits):
    decodes are planned with plain integer arithmetic, one row each; only prefill chunks use numpy ranges."""
    s = len(entries)
    width = max(len(seq.block_table) for seq, _ in entries)
    tables = np.zeros((s, width), dtype=np.int32)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    ctx = np.empty(s, dtype=np.int32)
    qlens = np.ones(s, dtype=np.int32)
    for i in range(num_decode):  # one token each: the last one, at position num_computed
        seq = entries[i][0]
        p = seq.num_computed
        bt = seq.block_table
        tables[i, : len(bt)] = bt
        # The token at position p: on the host, or (async scheduling) still on the device: 0 here, and the
        # runner copies it in from the previous step's sampled tokens (prev_rows / prev_src).
        ids.append(0 if seq.num_pending else seq.token_at(p))
        pos.append(p)
        slots.append(bt[p // block_size] * block_size + p % block_size)
        ctx[i] = p + 1
    rows = list(range(num_decode))
    prev_rows = [i for i in range(num_decode) if entries[i][0].num_pending]
    pos_parts = [np.asarray(pos, dtype=np.int64)]
    slot_parts = [np.asarray(slots, dtype=np.int64)]
    row = num_decode
    for i in range(num_decode, s):
        seq, n = entries[i]
        start = seq.num_computed
        bt = seq.block_table
        tables[i, : len(bt)] = bt
        p = np.arange(start, start + n, dtype=np.int64)
        if seq.num_pending:
            raise RuntimeError(f"{seq.request_id}: a prefill chunk with a token still on the device (scheduler bug)")
        ids.extend(seq.tokens(start, start + n))
        pos_parts.append(p)
        slot_parts.append(tables[i, p // block_size].astype(np.int64) * block_size + p % block_size)
        ctx[i] = start + n
        qlens[i] = n
        row += n
        if start + n == seq.num_tokens:  # reaches the end of what it has: samples its next token
            rows.append(row - 1)
    x = StepInputs(
        np.asarray(ids, dtype=np.int64),
        np.concatenate(pos_parts),
        np.concatenate(slot_parts),
        num_decode,
        ctx,
        qlens,
        tables,
        np.asarray(rows, dtype=np.int64),
    )
    if prev_rows:
        x.prev_rows = np.asarray(prev_rows, dtype=np.int64)
        x.prev_src = np.asarray([entries[i][0].pending_row for i in prev_rows], dtype=np.int64)
    return x


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [rows, vocab] static output: a view of the runner's one shared logits buffer


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        backend: AttentionBackend,
        *,
        max_num_seqs: int,
        max_model_len: int,
        cuda_graphs: bool,
        device: torch.device,
        dtype: torch.dtype,
        max_num_batched_tokens: int = 8192,
    ) -> None:
        cfg = model.config
        self.model, self.cache, self.device, self.dtype = model, cache, device, dtype
        self.backend = backend
        bind_backend(model, backend)
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks = -(-max_model_len // cache.block_size)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_model_len, device, dtype)
        self.use_cuda_graphs = (
            cuda_graphs and device.type == "cuda" and backend.supports_cuda_graphs and model.is_first and model.is_last
        )
        self.ladder = bucket_ladder(max_num_seqs)
        # mixed steps of up to max_tokens tokens replay graphs; larger ones (long-prompt chunks) run eagerly
        self.max_tokens = min(max_num_batched_tokens, MIXED_GRAPH_MAX_TOKENS)
        self.token_ladder = token_ladder(self.max_tokens)
        # decode graphs by (bucket, variant): the backend's decode_graph_variants (e.g. with shared-prefix attention)
        self._graphs: dict[tuple[int, object], _Graph] = {}
        self._mixed_graphs: dict[int, _Graph] = {}
        self._static: dict[str, torch.Tensor] | None = None
        self._pool = None
        # Every graph's LM head writes into this one [max_num_seqs, vocab] float32 buffer (allocated at the
        # first capture, outside the graph pool): graphs replay one at a time and a step's logits are sampled
        # before the next step replays, so one buffer serves them all (per-graph outputs would cost
        # sum(ladder) + len(token ladder) * max_num_seqs rows: gigabytes of a large vocabulary).
        self._logits: torch.Tensor | None = None
        self.graph_memory_bytes = 0  # what capture_all's graphs (their pool, static buffers, logits) took
        # Every host -> device copy of a step goes through pinned staging (async scheduling must not wait):
        # room for the token arrays, one block-table row per sequence, the prefill tiles and the sampler's rows.
        t, n = max_num_batched_tokens, max_num_seqs
        self.staging = HostStaging(
            device,
            8 * 4 * t + 4 * (n + 1) * (self.max_blocks + 8) + 8 * (n + 1 + t) + 64 * n + (1 << 20),
        )

    # --- running a step -----------------------------------------------------------------------------
    @torch.no_grad()
    def execute(
        self,
        x: StepInputs,
        prev_tokens: torch.Tensor | None = None,
        hidden: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one step on this rank. The last stage returns logits [len(logits_rows), vocab] float32 (identical
        on every TP rank); another stage returns (hidden, residual) [N, hidden] for the next one. prev_tokens:
        the previous step's sampled ids on the device, when x.prev_rows takes ids from them (first stage);
        hidden: the previous stage's (hidden, residual) (every stage but the first)."""
        if len(x.prev_rows) and prev_tokens is None and self.model.is_first:
            raise ValueError(f"the step takes {len(x.prev_rows)} token ids from the previous step's samples; pass them")
        if (hidden is None) != self.model.is_first:
            raise ValueError("a pipeline stage after the first takes the previous stage's (hidden, residual)")
        self.staging.begin_step()
        if self.use_cuda_graphs and x.num_decode == x.num_tokens and x.num_decode <= self.max_num_seqs:
            return self._replay(x, prev_tokens)
        if (
            self.use_cuda_graphs
            and x.num_tokens <= self.max_tokens
            and len(x.q_lens) <= self.max_num_seqs
            and not self.backend.eager_only(x.num_decode, x.q_lens, x.context_lens)
        ):
            return self._replay_mixed(x, prev_tokens)
        h2d = self.staging.tensor
        positions = h2d(x.positions)
        cos, sin = self.rope.lookup(positions)
        meta = self.backend.build_metadata(
            x.num_decode, x.q_lens, x.context_lens, x.block_tables, cos, sin, h2d(x.slots), h2d
        )
        if hidden is not None:
            return self.model(hidden[0], meta, self.cache, residual=hidden[1], logits_indices=h2d(x.logits_rows))
        ids = h2d(x.token_ids)
        self._fill_prev(ids, x, prev_tokens)
        return self.model(ids, meta, self.cache, logits_indices=h2d(x.logits_rows))

    def _fill_prev(self, ids: torch.Tensor, x: StepInputs, prev_tokens: torch.Tensor | None) -> None:
        """ids[prev_rows] = prev_tokens[prev_src], on the device, in stream order: after the previous step's
        sampling, before this step's forward (async scheduling never waits for the host to see a token)."""
        if len(x.prev_rows):
            rows = self.staging.tensor(x.prev_rows)
            src = self.staging.tensor(x.prev_src)
            ids.index_copy_(0, rows, prev_tokens.index_select(0, src))

    # --- CUDA graphs ------------------------------------------------------------------------------------
    def _static_buffers(self) -> dict[str, torch.Tensor]:
        """The runner's static inputs of both graph kinds (the backend keeps the attention metadata's)."""
        if self._static is None:
            t, n, dev = self.max_tokens, self.max_num_seqs, self.device
            self._static = {
                "ids": torch.zeros(t, dtype=torch.int64, device=dev),
                "positions": torch.zeros(t, dtype=torch.int64, device=dev),
                "slots": torch.zeros(t, dtype=torch.int64, device=dev),
                "rows": torch.zeros(n, dtype=torch.int64, device=dev),  # mixed graphs' sampled rows
            }
            self.backend.init_graphs(n, t, self.max_blocks)
        return self._static

    def _put_tokens(self, x: StepInputs, bucket: int) -> None:
        """Token ids, positions and slots of the step's rows, padded to the bucket (token 0, position 0, slot 0)."""
        st, pad, put = self._static, bucket - x.num_tokens, self.staging.copy_
        put(st["ids"][:bucket], np.concatenate([x.token_ids, np.zeros(pad, np.int64)]))
        put(st["positions"][:bucket], np.concatenate([x.positions, np.zeros(pad, np.int64)]))
        put(st["slots"][:bucket], np.concatenate([x.slots, np.zeros(pad, np.int64)]))

    def _replay(self, x: StepInputs, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        b = x.num_decode
        bucket = next(s for s in self.ladder if s >= b)
        st = self._static_buffers()
        self._put_tokens(x, bucket)
        variant = self.backend.prepare_decode_replay(bucket, x.context_lens, x.block_tables, self.staging.copy_)
        self._fill_prev(st["ids"], x, prev_tokens)
        g = self._graphs.get((bucket, variant))
        if g is None:
            g = self._graphs[bucket, variant] = self._capture_with(lambda: self._decode_forward(bucket, variant))
        g.graph.replay()
        return g.logits[:b]

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        if self._logits is None:
            self._logits = torch.empty(
                self.max_num_seqs, self.model.config.vocab_size, dtype=torch.float32, device=self.device
            )
        return self._logits[:rows]

    def _decode_forward(self, bucket: int, variant: bool = False) -> torch.Tensor:
        st = self._static_buffers()
        cos, sin = self.rope.lookup(st["positions"][:bucket])
        meta = self.backend.decode_graph_metadata(bucket, cos, sin, st["slots"][:bucket], variant)
        return self.model(st["ids"][:bucket], meta, self.cache, logits_out=self._logits_buffer(bucket))

    def _mixed_forward(self, bucket: int) -> torch.Tensor:
        st = self._static_buffers()
        cos, sin = self.rope.lookup(st["positions"][:bucket])
        meta = self.backend.mixed_graph_metadata(bucket, cos, sin, st["slots"][:bucket])
        return self.model(
            st["ids"][:bucket],
            meta,
            self.cache,
            logits_indices=st["rows"],
            logits_out=self._logits_buffer(self.max_num_seqs),
        )

    def _replay_mixed(self, x: StepInputs, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        bucket = next(b for b in self.token_ladder if b >= x.num_tokens)
        st = self._static_buffers()
        self._put_tokens(x, bucket)
        rows = np.zeros(self.max_num_seqs, dtype=np.int64)
        rows[: len(x.logits_rows)] = x.logits_rows
        self.staging.copy_(st["rows"], rows)
        self.backend.prepare_mixed_replay(
            bucket, x.num_decode, x.q_lens, x.context_lens, x.block_tables, self.staging.copy_
        )
        self._fill_prev(st["ids"], x, prev_tokens)
        g = self._mixed_graphs.get(bucket)
        if g is None:
            g = self._mixed_graphs[bucket] = self._capture_with(lambda: self._mixed_forward(bucket))
        g.graph.replay()
        return g.logits[: len(x.logits_rows)]

    def _capture_with(self, forward) -> _Graph:
        """Capture forward() into the shared pool (spanllm.cuda_graph: two warm-up runs on the capture's side
        stream first). The warm-up runs write K/V at the static buffers' slots, which a replay writes again."""
        self._logits_buffer(1)  # allocated before the capture, so outside its pool
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        out: list[torch.Tensor] = []
        graph = capture_graph(lambda: out.append(forward()), self.device, warmup=2, pool=self._pool)
        return _Graph(graph, out[-1])  # the captured run's logits: the graph's static output

    def capture_all(self) -> list[int]:
        """Capture every bucket of both ladders now (collective under TP: every rank calls it), with padding
        inputs (they write only reserved block 0). Returns the captured decode buckets ([] without graphs)."""
        if not self.use_cuda_graphs:
            return []
        before = torch.cuda.memory_reserved(self.device)
        st = self._static_buffers()
        for bucket in self.ladder:
            for variant in self.backend.decode_graph_variants():
                if (bucket, variant) in self._graphs:
                    continue
                for name in ("ids", "positions", "slots"):
                    st[name].zero_()
                self.backend.reset_decode_graph()
                self._graphs[bucket, variant] = self._capture_with(
                    lambda b=bucket, v=variant: self._decode_forward(b, v)
                )
        for bucket in self.token_ladder:
            if bucket in self._mixed_graphs:
                continue
            for t in st.values():
                t.zero_()
            self.backend.reset_mixed_graph()  # padding only: every tile empty, every token writes slot 0
            self._mixed_graphs[bucket] = self._capture_with(lambda b=bucket: self._mixed_forward(b))
        torch.cuda.synchronize(self.device)
        self.graph_memory_bytes += torch.cuda.memory_reserved(self.device) - before  # the pool keeps what it freed
        return self.captured_buckets

    @property
    def captured_buckets(self) -> list[int]:
        return sorted({bucket for bucket, _ in self._graphs})

    @property
    def captured_token_buckets(self) -> list[int]:
        return sorted(self._mixed_graphs)

    def reset_graphs(self) -> None:
        self._graphs.clear()
        self._mixed_graphs.clear()
        self._pool = None
        self._logits = None
