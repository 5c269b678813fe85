"""Vocabulary-parallel embedding and LM head.

`VocabParallelEmbedding` sums the partial lookups with `torch.distributed.all_reduce` on the TP group, and
`ParallelLMHead` gathers logit shards with an all-gather: process-group collectives, not the communicator,
once per forward each, outside the decoder layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spanllm.layers.tp import TPContext


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split in rows: rank r holds ids [r*Vp, (r+1)*Vp), Vp = ceil(V/tp).

    Rows past the real vocabulary (padding on the last rank) exist only to keep shards equal.
    """

    def __init__(self, vocab_size: int, hidden: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_local = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_local
        self.vocab_stop = min(self.vocab_start + self.vocab_local, vocab_size)  # real rows: [start, stop)
        self.weight = tp.empty(self.vocab_local, hidden)  # [Vp, hidden]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] int64 -> [B, T, hidden]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        owned = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight)
        out = out * owned.unsqueeze(-1).to(out.dtype)
        dist.all_reduce(out, group=self.tp.group)  # process-group collective, not the communicator
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over the local vocabulary rows, then gathered: every TP rank gets the full row."""

    def forward(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, written into `out` when given (the serving engine's graphs share
        one logits buffer instead of each keeping its own)."""
        local = self.tp.linear(h, self.weight)  # [N, Vp]
        n, tp, vl = local.shape[0], self.tp.size, self.vocab_local
        if tp > 1:
            gathered = torch.empty(tp * n, vl, device=local.device, dtype=local.dtype)
            _all_gather_single(gathered, local, group=self.tp.group)  # [tp*N, Vp], rank-major
            exact = tp * vl == self.vocab_size  # no padding rows in the vocabulary
            dst = (
                out if out is not None and exact else torch.empty(n, tp * vl, device=local.device, dtype=torch.float32)
            )
            # One pass: rank-major -> row-major ([tp, N, Vp] -> [N, tp, Vp]) and to float32 together.
            dst.view(n, tp, vl).copy_(gathered.view(tp, n, vl).transpose(0, 1))
            if dst is out:
                return out
            full = dst[:, : self.vocab_size]
            return full if out is None else out.copy_(full)
        if out is None:
            return local[:, : self.vocab_size].float()
        return out.copy_(local[:, : self.vocab_size])


# torch >= 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.11 has only the old.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
