"""ModelRunner: runs one stage's model over the KV cache, prefill eagerly, decode eagerly or replaying
a CUDA graph.

Decode graphs are captured per (batch size, first cache slot) on first use: the batch size is the
bucket (a generate call keeps its batch size for its whole decode, finished sequences included, so
no padding rows are needed and none can write into another micro-batch's slots). Inside a graph the
attention reads the whole cache length (`max_seq_len`) under a mask computed from the positions
tensor, so one graph serves every step. The communicator's all-reduce is captured with the rest:
it must be graph-capturable (NCCL's `dist.all_reduce` on the current stream is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spanllm.engine.attention import AttentionMetadata
from spanllm.engine.config import EngineConfig
from spanllm.engine.kv_cache import KVCache
from spanllm.engine.model import LlamaForCausalLM
from spanllm.engine.rope import RotaryEmbedding


@dataclass
class _DecodeGraph:
    graph: "torch.cuda.CUDAGraph"
    x: torch.Tensor  # static input: ids [B, 1] or hidden [B, 1, hidden]
    positions: torch.Tensor  # static [B] int64
    out: torch.Tensor  # static output: logits [B, vocab] or hidden [B, 1, hidden]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, engine: EngineConfig, device: torch.device) -> None:
        cfg = model.config
        self.model = model
        self.engine = engine
        self.device = device
        qkv = next(iter(model.model.layers.values())).self_attn.qkv_proj
        self.kv_cache = KVCache(list(model.layer_ids), engine.max_batch_size, qkv.num_kv_heads_local,
                                engine.max_seq_len, cfg.head_dim, device, engine.dtype)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, engine.max_seq_len, device,
                                    engine.dtype)
        self.graphs_allowed = engine.cuda_graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._pool = None

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
            raise ValueError(f"prompt length {t} exceeds max_seq_len={self.engine.max_seq_len}; "
                             "raise EngineConfig.max_seq_len")
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

    def _decode_forward(self, x: torch.Tensor, positions: torch.Tensor, slot_start: int, kv_len: int) -> torch.Tensor:
        pos = positions[:, None]  # [B, 1]
        cos, sin = self.rope.lookup(pos)
        keys = torch.arange(kv_len, device=self.device)
        mask = (keys[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, kv_len]
        meta = AttentionMetadata(False, slot_start, pos, cos, sin, mask, kv_len)
        return self.model(x, meta, self.kv_cache)

    def _capture(self, x: torch.Tensor, positions: torch.Tensor, slot_start: int) -> _DecodeGraph:
        static_x, static_pos = x.clone(), positions.clone()
        kv_len = self.engine.max_seq_len
        # Warm up on a side stream (lazy inits, NCCL communicator setup). These runs write this step's
        # K/V at these positions: the replay that follows writes the same values again.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode_forward(static_x, static_pos, slot_start, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._decode_forward(static_x, static_pos, slot_start, kv_len)
        return _DecodeGraph(graph, static_x, static_pos, out)

    @property
    def captured_buckets(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)
