"""ModelRunner: runs one stage's model over the KV cache, prefill eagerly, decode eagerly or replaying
a CUDA graph.

Two decode entry points:

- `decode(x, positions, ...)`: one forward of a stage (any pipeline depth): input in, logits or hidden
  states out. Pipelined stages use it (their input arrives from a neighbour each step).
- `start_steps(...)` + `step(...)`: the whole-model (pp = 1) step, device-resident. A `DecodeSteps`
  bucket holds static buffers (the input tokens, their positions, a step counter and the history of
  generated tokens); one step runs embedding -> layers -> final norm -> LM head -> logits gather ->
  sampling (greedy argmax, or temperature/top-p with the sampler's device generator), writes the new
  token into the history and the next input, and advances positions and the counter, all on the
  device. With CUDA graphs the step is one graph replay and the host does nothing else per step.

Graphs are captured per (batch size, first cache slot[, sampling]) on first use: the batch size is
the bucket (a generate call keeps its batch size for its whole decode, finished sequences included,
so no padding rows are needed and none can write into another micro-batch's slots). Inside a graph
the attention reads the whole cache length (`max_seq_len`) under a mask computed from the positions
tensor, so one graph serves every step. The communicator's all-reduce (and the embedding's
all-reduce and the logits all-gather) are captured with the rest: they must be graph-capturable
(NCCL collectives on the current stream are).

`EngineConfig.compile_decode`: decode runs through `torch.compile(dynamic=False)` in the default mode; the
CUDA graph stays ours (never "reduce-overhead"). `compile_scope="layer"` (default) compiles one decoder
layer's compute, which every layer then runs (weights and cache views are its inputs): one compile per
bucket at any depth. `compile_scope="forward"` compiles the whole decode forward (rope lookup and mask ->
embedding -> layers -> final norm -> LM head); sampling and the step bookkeeping stay eager, still inside
the graph, in both.
The compiled forward always attends over max_seq_len (as a graph does), so one compile serves every step
of a bucket; dynamic=False specializes on the rest: one compile per (batch size, first cache slot, ids or
hidden input), i.e. one per captured bucket, and the graph capture's warm-up runs trigger it outside the
capture. The recompile limit is raised to cover every bucket of max_batch_size. With the breakdown
timers on, decode runs the eager forward (events need eager code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spanllm.attention.layer import AttentionMetadata
from spanllm.cuda_graph import capture_graph
from spanllm.engine.config import EngineConfig
from spanllm.engine.sampler import Sampler, SamplingParams
from spanllm.engine.static.kv_cache import KVCache
from spanllm.layers.rope import RotaryEmbedding
from spanllm.model.llama import LlamaForCausalLM


@dataclass
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # static input: ids [B, 1] or hidden [B, 1, hidden]
    positions: torch.Tensor  # static [B] int64
    out: torch.Tensor  # static output: logits [B, vocab] or hidden [B, 1, hidden]


class DecodeSteps:
    """Static device buffers of one whole-model decode bucket (pp = 1): batch rows [slot_start, +batch).

    tokens [B, 1]: the next step's input ids; positions [B]: where they go in the cache; step [1]: the
    history column the next sampled token goes to; history [B, max_seq_len]: column 0 is the token
    sampled after prefill, column s the token of decode step s. logits [B, vocab]: the last step's
    logits (a static graph output when captured)."""

    def __init__(self, batch: int, slot_start: int, sample_key: tuple, max_seq_len: int, device: torch.device) -> None:
        self.batch, self.slot_start, self.sample_key = batch, slot_start, sample_key
        self.tokens = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.history = torch.zeros(batch, max_seq_len, dtype=torch.int64, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def state(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.positions, self.step, self.history


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, engine: EngineConfig, device: torch.device) -> None:
        cfg = model.config
        self.model = model
        self.engine = engine
        self.device = device
        qkv = next(iter(model.model.layers.values())).self_attn.qkv_proj
        self.kv_cache = KVCache(
            list(model.layer_ids),
            engine.max_batch_size,
            qkv.num_kv_heads_local,
            engine.max_seq_len,
            cfg.head_dim,
            device,
            engine.dtype,
        )
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, engine.max_seq_len, device, engine.dtype
        )
        self.graphs_allowed = engine.cuda_graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._steps: dict[tuple, DecodeSteps] = {}
        self._pool = None
        # Built once: cache-position ids for the decode mask, and the mask's two values (SDPA adds a float
        # mask; a bool one it would convert in every layer).
        self._keys = torch.arange(engine.max_seq_len, device=device)
        self._mask_open = torch.zeros((), dtype=engine.dtype, device=device)
        self._mask_shut = torch.full((), float("-inf"), dtype=engine.dtype, device=device)
        self._compiled_forward = None
        if engine.compile_decode:
            _raise_recompile_limit(engine.max_batch_size)
            if engine.compile_scope == "forward":
                self._compiled_forward = torch.compile(
                    self._eager_forward, dynamic=False, fullgraph=False, backend=engine.compile_backend
                )
            else:  # "layer": one compiled block shared by every layer (LlamaDecoderLayer.block)
                for layer in self.model.model.layers.values():
                    layer.compiled_block = torch.compile(
                        layer.block, dynamic=False, fullgraph=False, backend=engine.compile_backend
                    )

    @property
    def use_cuda_graphs(self) -> bool:
        """Graphs on GPU unless disabled, and never while the per-op timers are on (events need eager code)."""
        return self.graphs_allowed and not self.model.tp.timers.enabled

    def reset_graphs(self) -> None:
        """Drop captured graphs (after swapping the communicator: the old one is baked into them).

        The memory pool goes with them: once its last graph is freed, torch's allocator must not see
        the pool id again (capturing into it trips an internal assert), so the next capture opens a new one.
        """
        self._graphs.clear()
        self._steps.clear()
        self._pool = None

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @torch.no_grad()
    def prefill(self, x: torch.Tensor, lengths: torch.Tensor, slot_start: int) -> torch.Tensor:
        """x: ids [B, T] right-padded (first stage) or hidden [B, T, hidden]; lengths [B] int64 on device.
        Returns logits [B, vocab] at each sequence's last prompt token (last stage) or hidden [B, T, hidden]."""
        b, t = x.shape[:2]
        if t > self.engine.max_seq_len:
            raise ValueError(
                f"prompt length {t} exceeds max_seq_len={self.engine.max_seq_len}; raise EngineConfig.max_seq_len"
            )
        positions = torch.arange(t, device=self.device).expand(b, t)  # [B, T]
        cos, sin = self.rope.lookup(positions)
        meta = AttentionMetadata(True, slot_start, positions, cos, sin)
        return self.model(x, meta, self.kv_cache, last_index=lengths - 1 if self.model.is_last else None)

    @torch.no_grad()
    def decode(self, x: torch.Tensor, positions: torch.Tensor, slot_start: int, kv_len: int) -> torch.Tensor:
        """One token per sequence. x: ids [B, 1] or hidden [B, 1, hidden]; positions [B] int64 (where this
        token goes); kv_len: an upper bound on positions + 1 (eager decode attends over that many).
        With CUDA graphs the result is a static buffer, overwritten by the next replay of this bucket."""
        if not self.use_cuda_graphs:
            return self._decode_forward(x, positions, slot_start, kv_len)
        key = (x.shape[0], slot_start)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(x, positions, slot_start)
        g.x.copy_(x)
        g.positions.copy_(positions)
        g.graph.replay()
        return g.out

    @property
    def compiled_decode(self) -> bool:
        """Decode runs the torch.compile'd forward (compile_decode, and the per-op timers are off)."""
        return self.engine.compile_decode and not self.model.tp.timers.enabled

    def _decode_forward(self, x: torch.Tensor, positions: torch.Tensor, slot_start: int, kv_len: int) -> torch.Tensor:
        if self.compiled_decode:
            # Always the whole cache length under the mask (as inside a graph): a per-step kv_len would be a
            # new static shape, hence a recompile, every step of eager (CPU) decode.
            if self._compiled_forward is not None:
                return self._compiled_forward(x, positions, slot_start, self.engine.max_seq_len)
            return self._eager_forward(x, positions, slot_start, self.engine.max_seq_len, compiled_layers=True)
        return self._eager_forward(x, positions, slot_start, kv_len)

    def _eager_forward(
        self, x: torch.Tensor, positions: torch.Tensor, slot_start: int, kv_len: int, compiled_layers: bool = False
    ) -> torch.Tensor:
        pos = positions[:, None]  # [B, 1]
        cos, sin = self.rope.lookup(pos)
        allowed = self._keys[None, :kv_len] <= pos  # [B, kv_len]
        mask = torch.where(allowed, self._mask_open, self._mask_shut)[:, None, None, :]  # [B, 1, 1, kv_len] additive
        b = x.shape[0]
        rows = self._keys[:b] if b <= self._keys.shape[0] else torch.arange(b, device=self.device)
        meta = AttentionMetadata(False, slot_start, pos, cos, sin, mask, kv_len, rows, compiled=compiled_layers)
        return self.model(x, meta, self.kv_cache)

    def _capture(self, x: torch.Tensor, positions: torch.Tensor, slot_start: int) -> _DecodeGraph:
        static_x, static_pos = x.clone(), positions.clone()
        kv_len = self.engine.max_seq_len
        # Two warm-up runs first (lazy inits, NCCL communicator setup). They write this step's K/V at these
        # positions: the replay that follows writes the same values again.
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        outs: list[torch.Tensor] = []
        graph = capture_graph(
            lambda: outs.append(self._decode_forward(static_x, static_pos, slot_start, kv_len)),
            self.device,
            warmup=2,
            pool=self._pool,
        )
        return _DecodeGraph(graph, static_x, static_pos, outs[-1])

    # --- the device-resident whole-model step (pp = 1) ---------------------------------------------------
    def start_steps(
        self,
        slot_start: int,
        first_tokens: torch.Tensor,
        positions: torch.Tensor,
        params: SamplingParams,
        sampler: Sampler,
    ) -> DecodeSteps:
        """The bucket for batch rows [slot_start, +len(first_tokens)), its buffers set for decode step 1:
        first_tokens [B] (sampled after prefill) become the input and history column 0; positions [B]
        are where they go (the prompt lengths). Device copies only."""
        if not self.model.is_first or not self.model.is_last:
            raise ValueError("start_steps runs the whole model (pp = 1); pipeline stages use decode()")
        b = first_tokens.shape[0]
        key = (b, slot_start, _sample_key(params))
        st = self._steps.get(key)
        if st is None:
            st = self._steps[key] = DecodeSteps(b, slot_start, key[2], self.engine.max_seq_len, self.device)
        st.tokens.copy_(first_tokens[:, None])
        st.positions.copy_(positions)
        st.history[:, 0].copy_(first_tokens)
        st.step.fill_(1)
        return st

    @torch.no_grad()
    def step(self, st: DecodeSteps, params: SamplingParams, sampler: Sampler, kv_len: int) -> torch.Tensor:
        """One decode step of the bucket, entirely on the device; returns its logits [B, vocab] (a static
        buffer with CUDA graphs: the next step overwrites it). kv_len bounds the eager attention (as in
        decode()); the graph attends over max_seq_len under its mask."""
        if not self.use_cuda_graphs:
            # Never overwrite st.logits here: with a captured graph it is the graph's static output
            # (timers may switch a bucket to eager and back), and freeing it would hand its memory back
            # to the pool while the graph still writes there.
            return self._step_body(st, params, sampler, kv_len)
        if st.graph is None:
            self._capture_step(st, params, sampler)
        st.graph.replay()
        return st.logits

    def _step_body(self, st: DecodeSteps, params: SamplingParams, sampler: Sampler, kv_len: int) -> torch.Tensor:
        logits = self._decode_forward(st.tokens, st.positions, st.slot_start, kv_len)
        nxt = sampler(logits, params)[:, None]  # [B, 1]
        st.history.index_copy_(1, st.step, nxt)
        st.tokens.copy_(nxt)
        st.positions.add_(1)
        st.step.add_(1)
        return logits

    def _capture_step(self, st: DecodeSteps, params: SamplingParams, sampler: Sampler) -> None:
        kv_len = self.engine.max_seq_len
        # Warm up on a side stream (lazy inits, NCCL communicator setup), restoring the buffers after each
        # run: the step writes this step's K/V at these positions, which the first replay writes again
        # (and the token it sampled at position + 1, which the mask hides until a real step overwrites it).
        saved = [t.clone() for t in st.state()]
        rng = sampler.generator.get_state() if params.temperature != 0.0 else None

        def restore() -> None:
            for t, s0 in zip(st.state(), saved):
                t.copy_(s0)

        def register(graph: torch.cuda.CUDAGraph) -> None:
            if rng is not None:
                sampler.generator.set_state(rng)  # the warm-up draws do not count
                # The sampler's own generator (not the default one): registered, each replay advances its
                # Philox offset, so every step draws fresh numbers and eager draws in between stay in sequence.
                graph.register_generator_state(sampler.generator)

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        outs: list[torch.Tensor] = []
        graph = capture_graph(
            lambda: outs.append(self._step_body(st, params, sampler, kv_len)),
            self.device,
            warmup=2,
            pool=self._pool,
            after_warmup=restore,
            before_capture=register,
        )
        st.logits = outs[-1]  # the captured run's logits: the graph's static output
        st.graph = graph  # capture ran nothing: the buffers still hold this step's input

    @property
    def captured_buckets(self) -> list[tuple[int, int]]:
        """(batch, first slot) of every captured decode graph (stage forwards and whole-model steps)."""
        keys = set(self._graphs) | {k[:2] for k, st in self._steps.items() if st.graph is not None}
        return sorted(keys)


def _raise_recompile_limit(max_batch_size: int) -> None:
    """dynamic=False compiles once per bucket: batch sizes 1..max_batch_size at any first slot, ids or
    hidden input. Past torch's recompile limit (8 by default) dynamo would silently fall back to eager
    for new buckets, so raise it (never lower it) to cover them."""
    cfg = torch._dynamo.config
    need = max_batch_size * (max_batch_size + 1) + 8  # 2 input kinds x n(n+1)/2 (batch, first slot) buckets
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), need))
            break
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 2 * need)


def _sample_key(params: SamplingParams) -> tuple:
    """What a captured step bakes in of the sampling parameters (greedy ignores top_p)."""
    return ("greedy",) if params.temperature == 0.0 else ("sample", params.temperature, params.top_p)
