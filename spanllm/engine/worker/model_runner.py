"""PagedModelRunner: turns a scheduled step into tensors, runs the forward over the paged KV cache, and
returns the logits of the rows that sample.

`StepInputs` is the whole step as host arrays (numpy): the plan rank 0 sends to the other TP ranks,
who run `execute` on it exactly as rank 0 does. Token layout: decode tokens first (one per sequence),
then prefill chunks; `logits_rows` picks the rows that sample (every decode, and each chunk that
reaches the end of its sequence).

CUDA graphs (decode-only steps, Triton attention): one graph per padded batch size of the bucket
ladder (1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs), captured on first use into one memory pool.
Static inputs: token ids, positions, slots, block tables [bucket, max_blocks_per_seq], context
lengths. A step of B decodes copies its B rows (and only the block-table columns it uses: the
kernel never reads past a sequence's context) and pads rows B..bucket with token 0 at position 0,
slot 0 (reserved block 0), context 1: they compute garbage nobody reads. The decode kernel's
context split is fixed per bucket. The all-reduces of the row-parallel layers are captured inside.
Mixed steps (any prefill chunk) replay a second kind of graph, keyed by the step's token count padded
to a token ladder (16, 32, 64, steps of 64 to 1024, of 128 to 2048, of 512 up to max_num_batched_tokens).
Every scheduled sequence is a chunk there (a decode: a chunk of one query, numbered first), and both
attention kernels run on fixed grids: the decode kernel over the first min(max_num_seqs, bucket) rows,
with context 0 on every row that is not one of this step's decodes (the kernel skips it), and the prefill
kernel over the prefill chunks' tiles, padded with tiles of an empty chunk (index max_num_seqs, no
queries: the program does nothing). Padded tokens write slot 0 and belong to no chunk (their rows hold
garbage that no other row reads: every op outside attention is row-wise), and the LM head runs on
max_num_seqs gathered rows, of which the step uses the first R. (`mixed_decode_kernel = False` puts the
decodes in the prefill kernel too, as one-query chunks: the first design, kept to measure against:
scripts/gpu_profile_steps.py.) Every step on CPU, and any step with graphs off, runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from spanllm.attention.paged import PagedMetadata
from spanllm.cuda_graph import capture_graph
from spanllm.engine.worker.host_staging import HostStaging
from spanllm.engine.worker.kv_cache import PagedKVCache
from spanllm.layers.rope import RotaryEmbedding
from spanllm.model.llama import LlamaForCausalLM

try:  # the Triton backend's host helpers (the CPU wheel has no Triton: the reference backend needs none)
    from spanllm.kernels.paged_attention import num_splits_for, prefill_block_q, prefill_tiles
except ImportError:
    num_splits_for = prefill_block_q = prefill_tiles = None


def token_ladder(max_tokens: int) -> list[int]:
    """Mixed-step buckets: 16, 32, 64, then steps of 64 to 1024, of 128 to 2048, of 512 beyond, capped at
    max_tokens. Every padded token runs through every GEMM, and mixed steps of a ShareGPT run hold ~250 decodes
    plus a prefill chunk (270-1270 tokens in 80% of them, results/h200/engine_speed): powers of two there
    padded a 615-token step to 1024."""
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
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [rows, vocab] static output: a view of the runner's one shared logits buffer


class PagedModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        *,
        max_num_seqs: int,
        max_model_len: int,
        backend: str,
        cuda_graphs: bool,
        device: torch.device,
        dtype: torch.dtype,
        max_num_batched_tokens: int = 8192,
    ) -> None:
        cfg = model.config
        self.model, self.cache, self.device, self.dtype = model, cache, device, dtype
        self.backend = backend
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks = -(-max_model_len // cache.block_size)
        qkv = next(iter(model.model.layers.values())).self_attn.qkv_proj
        self.kv_heads_local = qkv.num_kv_heads_local
        self.group = qkv.num_heads_local // qkv.num_kv_heads_local
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_model_len, device, dtype)
        # Graphs need the Triton decode kernel (the reference loops over host lists).
        self.use_cuda_graphs = cuda_graphs and device.type == "cuda" and backend == "triton"
        self.ladder = bucket_ladder(max_num_seqs)
        self.max_tokens = max_num_batched_tokens
        self.token_ladder = token_ladder(max_num_batched_tokens)
        self._graphs: dict[int, _DecodeGraph] = {}
        self._mixed_graphs: dict[int, _DecodeGraph] = {}
        self._mixed: dict[str, torch.Tensor] | None = None
        self._mixed_decode_kernel = True
        self._pool = None
        self._static: dict[str, torch.Tensor] | None = None
        # Every graph's LM head writes into this one [max_num_seqs, vocab] float32 buffer (allocated at the
        # first capture, outside the graph pool): graphs replay one at a time and a step's logits are sampled
        # before the next step replays, so one buffer serves them all (per-graph outputs would cost
        # sum(ladder) + len(token ladder) * max_num_seqs rows: 4.4 GiB of an 8B model's vocabulary at 256).
        self._logits: torch.Tensor | None = None
        self.graph_memory_bytes = 0  # what capture_all's graphs (their pool, static buffers, logits) took
        # Every host -> device copy of a step goes through pinned staging (async scheduling must not wait):
        # room for the token arrays, one block-table row per sequence, the prefill tiles and the sampler's rows.
        t, n = max_num_batched_tokens, max_num_seqs
        self.staging = HostStaging(
            device,
            8 * 4 * t
            + 4 * (n + 1) * (self.max_blocks + 8)
            + 8 * (n + 1 + t)  # tiles <= seqs + tokens
            + 64 * n
            + (1 << 20),
        )

    # --- metadata ------------------------------------------------------------------------------------
    def _metadata(self, x: StepInputs, positions: torch.Tensor, slots: torch.Tensor) -> PagedMetadata:
        nd = x.num_decode
        cos, sin = self.rope.lookup(positions)
        h2d = self.staging.tensor
        tables = h2d(x.block_tables)
        ctx = h2d(x.context_lens)
        reference = self.backend == "torch"  # the reference loops over host lists; the kernels read tensors
        meta = PagedMetadata(
            cos,
            sin,
            slots,
            nd,
            tables[:nd],
            ctx[:nd],
            logits_indices=h2d(x.logits_rows),
            backend=self.backend,
            decode_ctx_host=x.context_lens[:nd].tolist() if reference else None,
        )
        if nd:
            meta.num_splits = self._num_splits(nd)
        if nd < len(x.q_lens):
            q_lens = x.q_lens[nd:]
            cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
            np.cumsum(q_lens, out=cu[1:])
            meta.prefill_cu_q = h2d(cu)
            meta.prefill_context_lens = ctx[nd:]
            meta.prefill_block_tables = tables[nd:]
            if reference:
                meta.prefill_q_lens_host = q_lens.tolist()
                meta.prefill_ctx_host = x.context_lens[nd:].tolist()
            else:
                tiles = np.asarray(prefill_tiles(q_lens.tolist(), self.group), dtype=np.int32).reshape(-1, 2)
                meta.prefill_tiles = h2d(tiles)
        return meta

    def _num_splits(self, batch: int) -> int:
        if self.backend != "triton":
            return 1
        return num_splits_for(batch, self.kv_heads_local, self.device)

    # --- running a step -----------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, x: StepInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step on this rank; logits [len(logits_rows), vocab] float32 (identical on every TP rank).
        prev_tokens: the previous step's sampled ids on the device, when x.prev_rows takes ids from them."""
        if len(x.prev_rows) and prev_tokens is None:
            raise ValueError(f"the step takes {len(x.prev_rows)} token ids from the previous step's samples; pass them")
        self.staging.begin_step()
        if self.use_cuda_graphs and x.num_decode == x.num_tokens and x.num_decode <= self.max_num_seqs:
            return self._replay(x, prev_tokens)
        if self.use_cuda_graphs and x.num_tokens <= self.max_tokens and len(x.q_lens) <= self.max_num_seqs:
            return self._replay_mixed(x, prev_tokens)
        h2d = self.staging.tensor
        ids = h2d(x.token_ids)
        self._fill_prev(ids, x, prev_tokens)
        positions = h2d(x.positions)
        slots = h2d(x.slots)
        meta = self._metadata(x, positions, slots)
        return self.model(ids, meta, self.cache)

    def _fill_prev(self, ids: torch.Tensor, x: StepInputs, prev_tokens: torch.Tensor | None) -> None:
        """ids[prev_rows] = prev_tokens[prev_src], on the device, in stream order: after the previous step's
        sampling, before this step's forward (async scheduling never waits for the host to see a token)."""
        if len(x.prev_rows):
            rows = self.staging.tensor(x.prev_rows)
            src = self.staging.tensor(x.prev_src)
            ids.index_copy_(0, rows, prev_tokens.index_select(0, src))

    def _bucket(self, batch: int) -> int:
        return next(b for b in self.ladder if b >= batch)

    def _static_buffers(self) -> dict[str, torch.Tensor]:
        if self._static is None:
            n, dev = self.max_num_seqs, self.device
            self._static = {
                "ids": torch.zeros(n, dtype=torch.int64, device=dev),
                "positions": torch.zeros(n, dtype=torch.int64, device=dev),
                "slots": torch.zeros(n, dtype=torch.int64, device=dev),
                "tables": torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev),
                "ctx": torch.ones(n, dtype=torch.int32, device=dev),
            }
        return self._static

    def _replay(self, x: StepInputs, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        b = x.num_decode
        bucket = self._bucket(b)
        st = self._static_buffers()
        pad = bucket - b
        # Host arrays of bucket rows (padding rows: token 0, position 0, slot 0, context 1), copied in one go each.
        ids = np.concatenate([x.token_ids, np.zeros(pad, np.int64)])
        pos = np.concatenate([x.positions, np.zeros(pad, np.int64)])
        slots = np.concatenate([x.slots, np.zeros(pad, np.int64)])
        ctx = np.concatenate([x.context_lens, np.ones(pad, np.int32)])
        w = x.block_tables.shape[1]
        tables = np.zeros((bucket, w), np.int32)
        tables[:b] = x.block_tables
        put = self.staging.copy_
        put(st["ids"][:bucket], ids)
        put(st["positions"][:bucket], pos)
        put(st["slots"][:bucket], slots)
        put(st["ctx"][:bucket], ctx)
        put(st["tables"][:bucket, :w], tables)
        self._fill_prev(st["ids"], x, prev_tokens)
        g = self._graphs.get(bucket)
        if g is None:
            g = self._graphs[bucket] = self._capture_with(lambda b=bucket: self._graph_forward(b))
        g.graph.replay()
        return g.logits[:b]

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        if self._logits is None:
            self._logits = torch.empty(
                self.max_num_seqs, self.model.config.vocab_size, dtype=torch.float32, device=self.device
            )
        return self._logits[:rows]

    def _graph_forward(self, bucket: int) -> torch.Tensor:
        st = self._static_buffers()
        positions = st["positions"][:bucket]
        meta = PagedMetadata(
            *self.rope.lookup(positions),
            st["slots"][:bucket],
            bucket,
            st["tables"][:bucket],
            st["ctx"][:bucket],
            logits_indices=None,
            backend=self.backend,
            num_splits=self._num_splits(bucket),
            logits_out=self._logits_buffer(bucket),
        )
        return self.model(st["ids"][:bucket], meta, self.cache)

    # --- mixed steps in graphs ------------------------------------------------------------------------------
    def _max_tiles(self, tokens: int) -> int:
        return self.max_num_seqs + -(-tokens // prefill_block_q(self.group))

    def _mixed_buffers(self) -> dict[str, torch.Tensor]:
        if self._mixed is None:
            n, t, dev = self.max_num_seqs, self.max_tokens, self.device
            self._mixed = {
                "ids": torch.zeros(t, dtype=torch.int64, device=dev),
                "positions": torch.zeros(t, dtype=torch.int64, device=dev),
                "slots": torch.zeros(t, dtype=torch.int64, device=dev),
                # chunk n (one past the last real one) is the empty chunk the padding tiles point at
                "cu_q": torch.zeros(n + 2, dtype=torch.int32, device=dev),
                "ctx": torch.zeros(n + 1, dtype=torch.int32, device=dev),
                "tables": torch.zeros(n + 1, self.max_blocks, dtype=torch.int32, device=dev),
                "tiles": torch.zeros(self._max_tiles(t), 2, dtype=torch.int32, device=dev),
                "rows": torch.zeros(n, dtype=torch.int64, device=dev),
                "decode_ctx": torch.zeros(n, dtype=torch.int32, device=dev),  # 0: not a decode (kernel skips)
            }
        return self._mixed

    @property
    def mixed_decode_kernel(self) -> bool:
        """Whether mixed-step graphs run their decodes in the decode kernel (True, the default) or as one-query
        chunks of the prefill kernel. Setting it drops the captured mixed-step graphs."""
        return self._mixed_decode_kernel

    @mixed_decode_kernel.setter
    def mixed_decode_kernel(self, on: bool) -> None:
        if bool(on) != self._mixed_decode_kernel:
            self._mixed_decode_kernel = bool(on)
            self._mixed_graphs.clear()

    def _mixed_decode_rows(self, bucket: int) -> int:
        return min(self.max_num_seqs, bucket) if self._mixed_decode_kernel else 0

    def _mixed_forward(self, bucket: int) -> torch.Tensor:
        st = self._mixed_buffers()
        positions = st["positions"][:bucket]
        r = self._mixed_decode_rows(bucket)
        meta = PagedMetadata(
            *self.rope.lookup(positions),
            st["slots"][:bucket],
            0,
            st["tables"][:r],
            st["decode_ctx"][:r],
            prefill_cu_q=st["cu_q"],
            prefill_context_lens=st["ctx"],
            prefill_block_tables=st["tables"],
            prefill_tiles=st["tiles"][: self._max_tiles(bucket)],
            logits_indices=st["rows"],
            backend=self.backend,
            decode_rows=r,
            num_splits=self._num_splits(r) if r else 1,
            logits_out=self._logits_buffer(self.max_num_seqs),
        )
        return self.model(st["ids"][:bucket], meta, self.cache)

    def _reset_mixed(self) -> None:
        st = self._mixed_buffers()
        for t in st.values():
            t.zero_()
        st["tiles"][:, 0] = self.max_num_seqs  # every tile: the empty chunk

    def _replay_mixed(self, x: StepInputs, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        n = x.num_tokens
        bucket = next(b for b in self.token_ladder if b >= n)
        st = self._mixed_buffers()
        s = len(x.q_lens)
        pad = bucket - n
        cu = np.zeros(s + 1, dtype=np.int32)
        np.cumsum(x.q_lens, out=cu[1:])
        tiles = np.empty((self._max_tiles(bucket), 2), dtype=np.int32)
        r = self._mixed_decode_rows(bucket)
        nd = x.num_decode if r else 0  # chunks [0, nd) are the decodes, left to the decode kernel
        real = np.asarray(prefill_tiles(x.q_lens[nd:].tolist(), self.group, nd), dtype=np.int32).reshape(-1, 2)
        tiles[: len(real)] = real
        tiles[len(real) :, 0], tiles[len(real) :, 1] = self.max_num_seqs, 0
        rows = np.zeros(self.max_num_seqs, dtype=np.int64)
        rows[: len(x.logits_rows)] = x.logits_rows
        w = x.block_tables.shape[1]
        put = self.staging.copy_
        put(st["ids"][:bucket], np.concatenate([x.token_ids, np.zeros(pad, np.int64)]))
        put(st["positions"][:bucket], np.concatenate([x.positions, np.zeros(pad, np.int64)]))
        put(st["slots"][:bucket], np.concatenate([x.slots, np.zeros(pad, np.int64)]))
        put(st["cu_q"][: s + 1], cu)
        st["cu_q"][s + 1 :].fill_(int(cu[-1]))  # every later chunk, the padding tiles' one included, is empty
        put(st["ctx"][:s], x.context_lens)
        put(st["tables"][:s, :w], x.block_tables)
        put(st["tiles"][: len(tiles)], tiles)
        put(st["rows"], rows)
        if r:
            dctx = np.zeros(r, dtype=np.int32)
            dctx[:nd] = x.context_lens[:nd]
            put(st["decode_ctx"][:r], dctx)
        self._fill_prev(st["ids"], x, prev_tokens)
        g = self._mixed_graphs.get(bucket)
        if g is None:
            g = self._mixed_graphs[bucket] = self._capture_with(lambda: self._mixed_forward(bucket))
        g.graph.replay()
        return g.logits[: len(x.logits_rows)]

    def _capture_with(self, forward) -> _DecodeGraph:
        """Capture forward() into the shared pool (spanllm.cuda_graph: two warm-up runs on the capture's side
        stream first). The warm-up runs write K/V at the static buffers' slots, which a replay writes again."""
        self._logits_buffer(1)  # allocated before the capture, so outside its pool
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        out: list[torch.Tensor] = []
        graph = capture_graph(lambda: out.append(forward()), self.device, warmup=2, pool=self._pool)
        return _DecodeGraph(graph, out[-1])  # the captured run's logits: the graph's static output

    def capture_all(self) -> list[int]:
        """Capture every bucket of the ladder now (collective under TP: every rank calls it), with padding
        inputs (they write only reserved block 0). Returns the captured buckets ([] without graphs)."""
        if not self.use_cuda_graphs:
            return []
        before = torch.cuda.memory_reserved(self.device)
        st = self._static_buffers()
        for bucket in self.ladder:
            if bucket in self._graphs:
                continue
            for name in ("ids", "positions", "slots", "tables"):
                st[name].zero_()
            st["ctx"].fill_(1)
            self._graphs[bucket] = self._capture_with(lambda b=bucket: self._graph_forward(b))
        for bucket in self.token_ladder:  # largest first would not matter: one pool, captured in turn
            if bucket in self._mixed_graphs:
                continue
            self._reset_mixed()  # padding only: every tile empty, every token writes slot 0
            self._mixed_graphs[bucket] = self._capture_with(lambda b=bucket: self._mixed_forward(b))
        torch.cuda.synchronize(self.device)
        self.graph_memory_bytes += torch.cuda.memory_reserved(self.device) - before  # the pool keeps what it freed
        return self.captured_buckets

    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self._graphs)

    @property
    def captured_token_buckets(self) -> list[int]:
        return sorted(self._mixed_graphs)

    def reset_graphs(self) -> None:
        self._graphs.clear()
        self._mixed_graphs.clear()
        self._pool = None
        self._logits = None
