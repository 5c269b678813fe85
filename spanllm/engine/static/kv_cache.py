"""KVCache: static per-slot key/value buffers for the decoder layers of one pipeline stage.

One (k, v) pair per layer, each [max_batch, kv_heads_local, max_seq_len, head_dim]. A sequence owns
one slot (a batch row) for its whole life; a micro-batch owns a contiguous range of slots, so its
cache is a view (no gather) and a captured decode graph sees fixed addresses.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        layer_ids: list[int],
        max_batch: int,
        kv_heads_local: int,
        max_seq_len: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        shape = (max_batch, kv_heads_local, max_seq_len, head_dim)
        self.k = {i: torch.zeros(shape, device=device, dtype=dtype) for i in layer_ids}
        self.v = {i: torch.zeros(shape, device=device, dtype=dtype) for i in layer_ids}

    def layer(self, layer_id: int, slot_start: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [batch, kv_heads_local, max_seq_len, head_dim] of one layer's slots."""
        if slot_start + batch > self.max_batch:
            raise ValueError(
                f"slots [{slot_start}, {slot_start + batch}) exceed the cache's max_batch="
                f"{self.max_batch}; raise EngineConfig.max_batch_size"
            )
        return (self.k[layer_id][slot_start : slot_start + batch], self.v[layer_id][slot_start : slot_start + batch])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
