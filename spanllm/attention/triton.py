"""The Triton backend: the paged decode and prefill kernels (spanllm.kernels.paged_attention), RoPE and both
cache writes in one fused kernel, and the static metadata of the runner's two kinds of CUDA graph.

Decode graphs (decode-only steps) hold block tables [bucket, max_blocks] and context lengths [bucket]; a replay
copies a step's B rows (only the block-table columns it uses: the kernel never reads past a sequence's context)
and pads rows B..bucket with context 1 over block 0. The decode kernel's context split is fixed per bucket.
With shared-prefix attention on, each bucket has a second decode graph that runs its stage 1 first over a
unit buffer of fixed size (max_units: the grid), the step's units first and padding units (t0 = t1: nothing) after;
the plan's row_prefix / row_splits are 0 on padding rows. A step whose plan has no group replays the plain graph.
Mixed graphs keep the plain decode kernel (shared prefixes are read per sequence there).

Mixed graphs (any prefill chunk) number every scheduled sequence as a chunk (decodes first) and run both
kernels on fixed grids: the decode kernel over the first min(max_num_seqs, bucket) rows, with context 0 on
every row that is not one of this step's decodes (the kernel skips it), and the prefill kernel over the
prefill chunks' tiles, padded with tiles of an empty chunk (index max_num_seqs, no queries: the program does
nothing). Each kernel writes only its own rows of the one output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spanllm.attention.backend import AttentionBackend, HostToDevice, write_kv
from spanllm.attention.cascade import (
    CASCADE_ATTENTION,
    CASCADE_SHAPE_BUCKET,
    CUDNN_CASCADE_COST,
    DEFAULT_CASCADE_MIN_PREFIX,
    PREFILL_ATTENTION,
    CascadeChunk,
    CascadeShape,
    attend_long_chunks,
    cascade_plan_parts,
    chunk_shapes,
    plan_cascade,
    resolve_prefill_attention,
    warm_chunk_shapes,
)
from spanllm.attention.metadata import AttentionMetadata
from spanllm.attention.shared_prefix import (
    DEFAULT_MIN_SHARED_KEYS,
    SharedPrefixPlan,
    max_units,
    members_per_group,
    plan_shared_prefix,
)
from spanllm.kernels import paged_attention as kernels
from spanllm.kernels.fused_ops import rope_and_cache
from spanllm.kernels.prefill_config import PrefillConfig, prefill_block_q, prefill_config
from spanllm.layers.rope import apply_rotary


@dataclass
class TritonMetadata(AttentionMetadata):
    prefill_tiles: torch.Tensor | None = None  # [T, 2] int32: (chunk index, first query) per query tile
    num_splits: int = 1  # decode: context splits per (sequence, KV head); fixed per captured bucket
    # Mixed-step graphs: the decode kernel runs over rows [0, decode_rows), whose decode_context_lens are a
    # decode's context or 0 (not a decode: the kernel skips the row); 0: not such a graph.
    decode_rows: int = 0
    # Eager steps with the cascade on: the prefill chunks it runs (prefill_tiles leave them out)
    cascade: list[CascadeChunk] | None = None
    # The decodes' shared-prefix plan on the device (spanllm.attention.shared_prefix); None: every decode reads
    # its whole context
    shared: kernels.SharedPrefixTensors | None = None


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        prefill_config: PrefillConfig | None = None,
        prefill_attention: str = "triton",
        cascade_min_prefix: int | None = None,
        shared_prefix: bool = True,
        min_shared_keys: int = DEFAULT_MIN_SHARED_KEYS,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        num_layers: int | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        # Decodes sharing at least min_shared_keys cached keys read them once per group (shared_prefix.py);
        # only where a group holds two or more members (g query heads each fill GROUP_ROWS rows)
        self.members = members_per_group(self.group)
        self.shared_prefix = shared_prefix and self.members >= 2
        self.min_shared_keys = min_shared_keys
        self.block_size = block_size  # the KV cache's: shared prefixes are whole blocks
        sms = kernels.num_sms_of(device) if device.type == "cuda" else 8
        self.target_units = max(1, 2 * sms // num_kv_heads)
        if prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention={prefill_attention!r} must be one of {PREFILL_ATTENTION}")
        if cascade_min_prefix is not None and cascade_min_prefix < 0:
            raise ValueError(f"cascade_min_prefix={cascade_min_prefix} must be >= 0 (0: every prefill chunk)")
        # prefill chunks with at least cascade_min_prefix cached keys run the cascade (spanllm.attention.cascade)
        # with this attention for its parts (0: every chunk; one without a prefix is its square causal part
        # alone); None: every chunk on the Triton prefill kernel
        self.prefill_attention_asked = prefill_attention  # "auto" or a name; describe() shows both
        self.prefill_attention = resolve_prefill_attention(prefill_attention, device, dtype)  # dtype: compute's
        self.cascade = CASCADE_ATTENTION.get(self.prefill_attention)
        if self.cascade is None and cascade_min_prefix is not None:  # honoured or refused, never ignored
            why = "it is 'triton'"
            if prefill_attention == "auto":
                hopper = resolve_prefill_attention("auto", device, torch.bfloat16) != "triton"
                why = (
                    f"auto runs none in {str(dtype).removeprefix('torch.')}: a cascade takes bf16 / fp16"
                    if hopper
                    else "auto runs a cascade on a Hopper GPU only"
                )
            raise ValueError(
                f"cascade_min_prefix={cascade_min_prefix} chooses the chunks that run a cascade, and "
                f"prefill_attention={prefill_attention!r} runs none here ({why}); leave cascade_min_prefix unset"
            )
        self.cascade_min_prefix = DEFAULT_CASCADE_MIN_PREFIX if cascade_min_prefix is None else cascade_min_prefix
        self.cascade_bucket = CASCADE_SHAPE_BUCKET.get(self.prefill_attention, 1)  # its shapes' rounding, in rows
        # auto's cuDNN cascade takes a chunk only where CascadeCost estimates it faster than the paged kernel, for
        # the attention of every layer this runner's forward runs (num_layers; a plan serves them all). The plans
        # cuDNN holds are tracked here: those the warm-up built and those of every chunk planned since (cuDNN
        # keeps them for the process; the steps and the warm-up run on one thread, where its cache is).
        # Under TP every rank keeps this state alike (the same warm-up, then the same steps), so every rank makes
        # the same choice: it decides whether a step replays a graph (padded all-reduces) or runs eagerly (exact
        # ones), which the ranks must agree on.
        self.cascade_cost = (
            CUDNN_CASCADE_COST if prefill_attention == "auto" and self.prefill_attention == "cudnn-cascade" else None
        )
        if self.cascade_cost is not None and (num_layers is None or num_layers < 1):
            raise ValueError(
                f"num_layers={num_layers}: auto's cascade weighs a plan build against the attention of every layer "
                "the runner's forward runs; give that count (>= 1)"
            )
        self.flop_per_pair = 4.0 * num_heads * head_dim * (num_layers or 0)
        self._planned: set[tuple[str, int, int]] = set()
        # A chunk declined only for its plans adds the time the cascade would have saved to its missing plans'
        # account; once the account covers the plans, the next such chunk builds them (a shape that recurs is
        # worth its plans; one that does not costs at most twice the better choice: ski rental)
        self._forgone: dict[tuple[tuple[str, int, int], ...], float] = {}
        # The prefill kernel's tiling (None: its default for the dtype); tiles and kernel share its block_q.
        if prefill_config is not None:
            prefill_config.check_group(self.group)
        self.prefill_config = prefill_config
        self.block_q = prefill_block_q(self.group) if prefill_config is None else prefill_config.block_q
        self._decode: dict[str, torch.Tensor] | None = None
        self._mixed: dict[str, torch.Tensor] | None = None

    def describe(self, dtype: torch.dtype) -> str:
        if self.prefill_config is None:
            tiling = f"prefill tiling {prefill_config(self.group, dtype).label()}, the default"
        else:
            tiling = f"prefill tiling {self.prefill_config.label()}, set by prefill_tiling"
        if self.shared_prefix:
            tiling += f"; decodes sharing >= {self.min_shared_keys} cached keys read them once per group"
        auto = " (auto)" if self.prefill_attention_asked == "auto" else ""
        if self.cascade is not None:
            which = "every chunk" if self.cascade_min_prefix == 0 else f"prefixes >= {self.cascade_min_prefix} keys"
            if self.cascade_cost is not None:
                which += " where estimated faster than the paged kernel"
            tiling += f"; prefill {self.prefill_attention}{auto} for {which} in steps without decodes, eager"
            if self.cascade_bucket > 1:
                tiling += f", at shapes rounded to {self.cascade_bucket} rows"
        elif auto:
            tiling += "; prefill triton (auto: no cascade on this device)"
        return f"triton ({tiling})"

    def runs_cascade(self, num_decode: int) -> bool:
        """Whether this step's long-prefix chunks take the cascade: only in steps without decodes. Beside decodes
        the scheduler's attention budget cuts each chunk to a new size, so every step built new cuDNN plans (~45 ms
        each, at the exact shapes of then) and gave up the decode graph: on an H100 that made the decodes' p99
        inter-token latency 1.36 s against 0.23 s with the Triton kernel (results/h100/long_context/README.md, call
        D). The rounded shapes bound the plans now; the eager step (no decode graph) remains."""
        return self.cascade is not None and num_decode == 0

    def eager_only(self, num_decode: int, q_lens: np.ndarray, context_lens: np.ndarray) -> bool:
        """A step with a chunk for the cascade runs eagerly (no graph holds its gathers' sizes). The runner asks
        once per step, before it replays a graph or builds the step's metadata (plan_chunks); a step whose long
        chunks all run the paged kernel replays a graph, so their forgone savings are recorded here."""
        if not self.runs_cascade(num_decode):
            return False
        chunks = self._long_chunks(q_lens[num_decode:], context_lens[num_decode:])
        if any(self.takes_cascade(c, p) for _, c, p in chunks):
            return True
        self._declined(chunks)
        return False

    def _long_chunks(self, q_lens, context_lens) -> list[tuple[int, int, int]]:
        """(index, queries, prefix) of the prefill chunks with at least cascade_min_prefix cached keys."""
        return [
            (j, int(c), int(n) - int(c))
            for j, (c, n) in enumerate(zip(q_lens, context_lens))
            if n - c >= self.cascade_min_prefix
        ]

    def takes_cascade(self, c: int, prefix: int) -> bool:
        """Whether a chunk of c queries after `prefix` cached keys (>= cascade_min_prefix, in a step without
        decodes) runs the cascade: always for a cascade the user named; with auto, where CascadeCost estimates it
        faster than the paged kernel once its plans exist, and its missing plans' build (plan_s a part) is paid
        for by this chunk's saving plus what declined chunks missing the same plans would have saved. Pure:
        eager_only and build_metadata ask it for the same step (plan_chunks records after)."""
        if self.cascade_cost is None:
            return True
        missing, saving = self._estimate(c, prefix)
        if saving <= 0:
            return False
        return len(missing) * self.cascade_cost.plan_s < saving + self._forgone.get(missing, 0.0)

    def _estimate(self, c: int, prefix: int) -> tuple[tuple[tuple[str, int, int], ...], float]:
        """The chunk's cascade parts without a plan, and the time the cascade saves once planned."""
        cost = self.cascade_cost
        s = CascadeShape(c, prefix, self.cascade_bucket)
        missing = tuple(part for part in cascade_plan_parts(s) if part not in self._planned)
        saving = cost.paged_s(c, prefix, self.flop_per_pair) - cost.cascade_s(s, self.flop_per_pair, 0)
        return missing, saving

    def planned(self, c: int, prefix: int) -> None:
        """The cascade will run a chunk of c queries after `prefix` keys: cuDNN holds its parts' plans after (an
        account of forgone savings whose plans all exist now is closed)."""
        parts = cascade_plan_parts(CascadeShape(c, prefix, self.cascade_bucket))
        if self._planned.issuperset(parts):
            return
        self._planned.update(parts)
        for missing in [m for m in self._forgone if self._planned.issuperset(m)]:
            del self._forgone[missing]

    def plan_chunks(self, q_lens: list[int], context_lens: list[int]) -> list[CascadeChunk]:
        """The chunks of a step without decodes that run the cascade (takes_cascade), recording what it learns:
        the plans the taken chunks build, and the saving each chunk declined for its plans alone forwent."""
        plan = plan_cascade(q_lens, context_lens, self.cascade_min_prefix, self.takes_cascade)
        for ch in plan:
            self.planned(ch.q_len, ch.prefix)
        taken = {ch.chunk for ch in plan}
        self._declined([ch for ch in self._long_chunks(q_lens, context_lens) if ch[0] not in taken])
        return plan

    def _declined(self, chunks: list[tuple[int, int, int]]) -> None:
        """(index, queries, prefix) chunks that run the paged kernel: each one declined for its missing plans alone
        adds the saving it forwent to their account (takes_cascade)."""
        if self.cascade_cost is None:
            return
        for _, c, p in chunks:
            missing, saving = self._estimate(c, p)
            if saving > 0 and missing:
                self._forgone[missing] = self._forgone.get(missing, 0.0) + saving

    def warm_up_prefill(self, chunk: int, max_len: int, dtype: torch.dtype) -> list[tuple[int, int]]:
        """The cascade at every shape a prompt's chunks meet alone in a step (cuDNN builds a plan per (queries,
        keys) shape: ~80 ms a chunk on an H100, otherwise paid by the first prompt to meet it): full chunks and,
        the cuDNN cascade's shapes being rounded (CASCADE_SHAPE_BUCKET), every last chunk too."""
        if self.cascade is None:
            return []
        shapes = chunk_shapes(chunk, max_len, self.cascade_min_prefix, self.cascade_bucket)
        warm_chunk_shapes(
            self.cascade,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            dtype,
            self.device,
            shapes,
            self.cascade_bucket,
        )
        for c, p in shapes:
            self.planned(c, p)
        return shapes

    def num_splits(self, batch: int) -> int:
        return kernels.num_splits_for(batch, self.num_kv_heads, self.device)

    def tiles(self, q_lens: list[int], context_lens: list[int], first_chunk: int = 0) -> np.ndarray:
        tiles = kernels.prefill_tiles(q_lens, self.group, first_chunk, context_lens=context_lens, block_q=self.block_q)
        return np.asarray(tiles, dtype=np.int32).reshape(-1, 2)

    def build_metadata(
        self,
        num_decode: int,
        q_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        h2d: HostToDevice,
    ) -> TritonMetadata:
        nd = num_decode
        tables = h2d(block_tables)
        ctx = h2d(context_lens)
        meta = TritonMetadata(cos, sin, slot_mapping, nd, tables[:nd], ctx[:nd])
        if nd:
            meta.num_splits = self.num_splits(nd)
            plan = self.plan_shared(context_lens[:nd], block_tables[:nd])
            if plan is not None:
                meta.shared = kernels.SharedPrefixTensors(
                    h2d(plan.group_rows), h2d(plan.units), h2d(plan.row_prefix), h2d(plan.row_splits)
                )
        if nd < len(q_lens):
            chunk_lens = q_lens[nd:]
            cu = np.zeros(len(chunk_lens) + 1, dtype=np.int32)
            np.cumsum(chunk_lens, out=cu[1:])
            meta.prefill_cu_q = h2d(cu)
            meta.prefill_context_lens = ctx[nd:]
            meta.prefill_block_tables = tables[nd:]
            tile_lens = chunk_lens.tolist()
            if self.runs_cascade(nd):
                meta.cascade = self.plan_chunks(tile_lens, context_lens[nd:].tolist())
                for ch in meta.cascade:
                    tile_lens[ch.chunk] = 0  # no tiles: the kernel leaves its rows to the cascade
            meta.prefill_tiles = h2d(self.tiles(tile_lens, context_lens[nd:].tolist()))
        return meta

    def forward(
        self, qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonMetadata
    ) -> torch.Tensor:
        n = qk.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if qk.stride(0) == v.stride(0) and v.data_ptr() == qk.data_ptr() + qk.shape[1] * qk.element_size():
            # qk and v are views of one qkv row (the fused projection's layout): one kernel rotates and writes
            q = rope_and_cache(qk, meta.cos, meta.sin, meta.slot_mapping, k_cache, v_cache, hq, hkv, d)
        else:
            qk = apply_rotary(qk.view(n, hq + hkv, d), meta.cos, meta.sin)
            q = qk[:, :hq]
            write_kv(k_cache, v_cache, qk[:, hq:], v.view(n, hkv, d), meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta).reshape(n, hq * d)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonMetadata
    ) -> torch.Tensor:
        """q [N, hq, d] against the cache, which already holds this step's K/V -> [N, hq, d]."""
        nd = meta.num_decode
        if nd == q.shape[0]:
            return self._decode_rows(q, k_cache, v_cache, meta)
        prefill = (meta.prefill_block_tables, meta.prefill_cu_q, meta.prefill_context_lens, meta.prefill_tiles)
        if meta.cascade:  # a step without decodes (runs_cascade)
            out = torch.empty_like(q)
            if meta.prefill_tiles.shape[0]:  # the chunks the cascade does not run
                kernels.prefill(q, k_cache, v_cache, *prefill, out=out, config=self.prefill_config)
            attend_long_chunks(
                q, k_cache, v_cache, meta.prefill_block_tables, meta.cascade, self.cascade, out, self.cascade_bucket
            )
            return out
        if meta.decode_rows:  # a mixed-step graph: each kernel writes only its own rows of one output
            out = torch.empty_like(q)
            r = meta.decode_rows
            self._decode_rows(q[:r], k_cache, v_cache, meta, out[:r])
            return kernels.prefill(q, k_cache, v_cache, *prefill, out=out, config=self.prefill_config)
        if nd == 0:
            return kernels.prefill(q, k_cache, v_cache, *prefill, config=self.prefill_config)
        out = torch.empty_like(q)
        self._decode_rows(q[:nd], k_cache, v_cache, meta, out[:nd])
        out[nd:] = kernels.prefill(q[nd:], k_cache, v_cache, *prefill, config=self.prefill_config)
        return out

    def _decode_rows(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonMetadata, out=None
    ) -> torch.Tensor:
        """The decode kernel over meta's decode rows (q: theirs), with the step's shared-prefix plan if any."""
        return kernels.decode(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.num_splits,
            out=out,
            shared=meta.shared,
        )

    # --- decode graphs ----------------------------------------------------------------------------------
    def init_graphs(self, max_num_seqs: int, max_tokens: int, max_blocks: int) -> None:
        """Allocate the static buffers of both graph kinds (before any capture: outside the graphs' pool)."""
        n, dev = max_num_seqs, self.device
        self.max_num_seqs = n
        self._decode = {
            "tables": torch.zeros(n, max_blocks, dtype=torch.int32, device=dev),
            "ctx": torch.ones(n, dtype=torch.int32, device=dev),
            # the shared-prefix variant's plan (groups never exceed half the rows; units past a step's own are
            # padding: t0 = t1, nothing to do)
            "group_rows": torch.full((max(1, n // 2), self.members), -1, dtype=torch.int32, device=dev),
            "units": torch.zeros(max_units(n, self.target_units), 5, dtype=torch.int32, device=dev),
            "row_prefix": torch.zeros(n, dtype=torch.int32, device=dev),
            "row_splits": torch.zeros(n, dtype=torch.int32, device=dev),
        }
        self._mixed = {
            # chunk n (one past the last real one) is the empty chunk the padding tiles point at
            "cu_q": torch.zeros(n + 2, dtype=torch.int32, device=dev),
            "ctx": torch.zeros(n + 1, dtype=torch.int32, device=dev),
            "tables": torch.zeros(n + 1, max_blocks, dtype=torch.int32, device=dev),
            "tiles": torch.zeros(self.max_tiles(max_tokens), 2, dtype=torch.int32, device=dev),
            "decode_ctx": torch.zeros(n, dtype=torch.int32, device=dev),  # 0: not a decode (the kernel skips)
        }

    def max_tiles(self, tokens: int) -> int:
        return self.max_num_seqs + -(-tokens // self.block_q)

    def decode_graph_variants(self) -> tuple[bool, ...]:
        """The decode graphs of a bucket: plain, and with shared-prefix attention where it is on (a step whose
        plan has no group replays the plain one: it pays nothing for the feature)."""
        return (False, True) if self.shared_prefix else (False,)

    def decode_graph_metadata(
        self, bucket: int, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, shared: bool = False
    ) -> TritonMetadata:
        st = self._decode
        meta = TritonMetadata(
            cos, sin, slots, bucket, st["tables"][:bucket], st["ctx"][:bucket], num_splits=self.num_splits(bucket)
        )
        if shared:  # the grid of stage 1 is this bucket's unit count, fixed; padding units do nothing
            meta.shared = kernels.SharedPrefixTensors(
                st["group_rows"][: max(1, bucket // 2)],
                st["units"][: max_units(bucket, self.target_units)],
                st["row_prefix"][:bucket],
                st["row_splits"][:bucket],
            )
        return meta

    def reset_decode_graph(self) -> None:
        """Padding-only inputs for a capture: every row context 1 over block 0, no shared prefix."""
        st = self._decode
        st["tables"].zero_()
        st["ctx"].fill_(1)
        for name in ("units", "row_prefix", "row_splits"):
            st[name].zero_()
        st["group_rows"].fill_(-1)

    def plan_shared(self, context_lens: np.ndarray, block_tables: np.ndarray) -> SharedPrefixPlan | None:
        """The decodes' shared-prefix groups (host arrays, decodes only); None: off, or no group this step."""
        if not self.shared_prefix or len(context_lens) < 2:
            return None
        plan = plan_shared_prefix(
            block_tables,
            context_lens,
            self.block_size,
            kernels.BLOCK_N,
            min_keys=self.min_shared_keys,
            members=self.members,
            target_units=self.target_units,
        )
        return plan if plan.num_groups else None

    def prepare_decode_replay(self, bucket: int, context_lens: np.ndarray, block_tables: np.ndarray, put) -> bool:
        """Copy a step's rows into the decode graph's buffers (padding rows: context 1 over block 0); with a
        shared-prefix plan, its arrays too. Returns whether the step replays the shared-prefix variant."""
        st, b = self._decode, len(context_lens)
        pad = bucket - b
        w = block_tables.shape[1]
        tables = np.zeros((bucket, w), np.int32)
        tables[:b] = block_tables
        put(st["ctx"][:bucket], np.concatenate([context_lens, np.ones(pad, np.int32)]))
        put(st["tables"][:bucket, :w], tables)
        plan = self.plan_shared(context_lens, block_tables)
        if plan is None:
            return False
        units = np.zeros((max_units(bucket, self.target_units), 5), np.int32)
        units[: len(plan.units)] = plan.units
        put(st["units"][: len(units)], units)
        put(st["group_rows"][: plan.num_groups], plan.group_rows)
        put(st["row_prefix"][:bucket], np.concatenate([plan.row_prefix, np.zeros(pad, np.int32)]))
        put(st["row_splits"][:bucket], np.concatenate([plan.row_splits, np.zeros(pad, np.int32)]))
        return True

    # --- mixed graphs -----------------------------------------------------------------------------------
    def mixed_graph_metadata(
        self, bucket: int, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor
    ) -> TritonMetadata:
        st = self._mixed
        r = min(self.max_num_seqs, bucket)
        return TritonMetadata(
            cos,
            sin,
            slots,
            0,
            st["tables"][:r],
            st["decode_ctx"][:r],
            prefill_cu_q=st["cu_q"],
            prefill_context_lens=st["ctx"],
            prefill_block_tables=st["tables"],
            prefill_tiles=st["tiles"][: self.max_tiles(bucket)],
            decode_rows=r,
            num_splits=self.num_splits(r),
        )

    def reset_mixed_graph(self) -> None:
        """Padding-only inputs for a capture: every tile the empty chunk, every context 0."""
        for t in self._mixed.values():
            t.zero_()
        self._mixed["tiles"][:, 0] = self.max_num_seqs

    def prepare_mixed_replay(
        self, bucket: int, num_decode: int, q_lens: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray, put
    ) -> None:
        """Copy a step's chunks into the mixed graph's buffers; chunks [0, num_decode) are the decodes, which
        the decode kernel runs (their rows of decode_ctx hold their contexts, every other row 0)."""
        st = self._mixed
        s, nd = len(q_lens), num_decode
        cu = np.zeros(s + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        tiles = np.empty((self.max_tiles(bucket), 2), dtype=np.int32)
        real = self.tiles(q_lens[nd:].tolist(), context_lens[nd:].tolist(), nd)
        tiles[: len(real)] = real
        tiles[len(real) :, 0], tiles[len(real) :, 1] = self.max_num_seqs, 0
        w = block_tables.shape[1]
        put(st["cu_q"][: s + 1], cu)
        st["cu_q"][s + 1 :].fill_(int(cu[-1]))  # every later chunk, the padding tiles' one included, is empty
        put(st["ctx"][:s], context_lens)
        put(st["tables"][:s, :w], block_tables)
        put(st["tiles"][: len(tiles)], tiles)
        r = min(self.max_num_seqs, bucket)
        dctx = np.zeros(r, dtype=np.int32)
        dctx[:nd] = context_lens[:nd]
        put(st["decode_ctx"][:r], dctx)
