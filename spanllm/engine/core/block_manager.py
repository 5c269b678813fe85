"""BlockManager: the KV cache as a pool of fixed-size blocks, handed to sequences as they grow, with
automatic prefix caching (vLLM's APC, nano-vllm's block hashes).

Block ids index the PagedKVCache tensors. Block 0 is reserved (padded rows of a captured decode graph
write there), so sequences get ids 1 .. num_blocks - 1. A sequence's `block_table` lists its blocks
in position order; position p lives in block_table[p // block_size].

Prefix caching. A full block is keyed by the hash of its token ids chained with the hash of the block
before it (`hash_block`), so a key names the whole prefix up to the block's end and equal blocks under
different prefixes never alias. Once every position of a full block has its K/V computed by a step that
was already launched (`register`), its key maps to it and a new sequence whose tokens start with the same
prefix takes it (`lookup`, then `take`: reference count up) instead of computing it again. When nobody
references a registered block any more it stays findable in the evictable pool, least recently freed
first, until a block is needed and the free list is empty (`_take_one` evicts it: the key goes too).

Why the K/V a hit reads are right: a block is registered only after the steps that write all its positions
were launched, and the step that reads it is launched later, on the same stream (every TP rank runs the
plans in the same order). A sequence never writes a block it got from the cache: `lookup` leaves at least
the last token to compute (vLLM's rule: a step must run to sample from), whole blocks only, so writes
start in a block of its own. A registered block is never written again by its owner either (positions
are written once; a preempted sequence gives all its blocks back). A block is only reused for other
tokens after it was evicted, and the writes that reuse it come in later steps than the reads of earlier
steps. Hash: BLAKE2b (hashlib, 128-bit digest) over int32 token ids; a collision would hand a sequence
another prefix's K/V, so the hash is cryptographic (vLLM's reason for sha256), not Python's hash().

Invariant (checked by `check`, and by the tests after every request has finished or been aborted):
every usable block is in exactly one of three states: on the free list (count 0, no key), evictable
(count 0, registered), or referenced by exactly as many live sequences as its count says (registered or
not). The key map and the blocks' keys agree both ways.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from spanllm.engine.core.sequence import Sequence

RESERVED_BLOCKS = 1  # block 0
HASH_BYTES = 16


def hash_block(parent: bytes, token_ids: bytes) -> bytes:
    """Key of a full block: BLAKE2b over the previous block's key (b"" for the first) and the block's token
    ids (int32, native byte order)."""
    return hashlib.blake2b(parent + token_ids, digest_size=HASH_BYTES).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= RESERVED_BLOCKS:
            raise ValueError(
                f"num_blocks={num_blocks}: the pool needs more than {RESERVED_BLOCKS} block(s) "
                "(block 0 is reserved); give the KV cache more memory"
            )
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(RESERVED_BLOCKS, num_blocks))  # count 0, no key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # count 0, registered; least recently freed first
        self.cached: dict[bytes, int] = {}  # key -> registered block
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.num_evictions = 0

    @property
    def num_usable(self) -> int:
        return self.num_blocks - RESERVED_BLOCKS

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get: the free list and the evictable pool (nobody references either)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (vLLM's kv_cache_usage_perc: evictable blocks count as free)."""
        return 1.0 - self.num_free / self.num_usable

    @property
    def capacity_tokens(self) -> int:
        return self.num_usable * self.block_size

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def blocks_to_grow(self, seq: Sequence, num_positions: int) -> int:
        """Blocks seq still needs so that positions [0, num_positions) have a slot."""
        return max(0, self.blocks_for(num_positions) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_positions: int) -> bool:
        return self.blocks_to_grow(seq, num_positions) <= self.num_free

    # --- prefix cache ---------------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_full: int) -> list[bytes]:
        """Keys of seq's first num_full blocks (computed once per block and kept on the sequence: its token
        ids only ever grow, so they stay valid across preemption). Their tokens must be on the host."""
        keys = seq.block_hashes
        have = len(keys)
        if num_full > have:
            bs = self.block_size
            ids = array("i", seq.tokens(have * bs, num_full * bs))
            raw, step = ids.tobytes(), bs * ids.itemsize
            parent = keys[-1] if keys else b""
            for off in range(0, len(raw), step):
                parent = hash_block(parent, raw[off : off + step])
                keys.append(parent)
        return keys

    def lookup(self, seq: Sequence) -> list[int]:
        """The longest run of registered blocks that seq's tokens start with, leaving at least its last token
        to compute. Changes nothing (`take` claims them)."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        num_full = (len(seq.prompt_ids) + len(seq.output_ids) - 1) // self.block_size
        if num_full <= 0:
            return []
        hits = []
        cached = self.cached
        for key in self.block_hashes(seq, num_full):
            b = cached.get(key)
            if b is None:
                break
            hits.append(b)
        return hits

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many of these blocks sit in the evictable pool (taking them shrinks num_free)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def take(self, seq: Sequence, blocks: list[int]) -> None:
        """seq (holding no blocks) starts with these registered blocks, found by `lookup`."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id}: takes cached blocks while holding {len(seq.block_table)}")
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
        seq.block_table = list(blocks)
        seq.num_registered_blocks = len(blocks)

    def register(self, seq: Sequence) -> None:
        """Make seq's full blocks whose K/V are all computed findable. Callers: the scheduler, for the
        sequences its last step prefilled; `grow` and `free` (their computed blocks are final)."""
        if not self.enable_prefix_caching:
            return
        known = len(seq.prompt_ids) + len(seq.output_ids)  # ids on the host (a pending token is not)
        full = min(min(seq.num_computed, known) // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        keys = self.block_hashes(seq, full)
        table, block_keys, cached = seq.block_table, self.block_keys, self.cached
        for i in range(seq.num_registered_blocks, full):
            b, key = table[i], keys[i]
            if block_keys[b] is None and key not in cached:  # else a copy of a block that is already findable
                cached[key] = b
                block_keys[b] = key
        seq.num_registered_blocks = full

    # --- allocation -----------------------------------------------------------------------------------
    def _take_one(self) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        b, _ = self.evictable.popitem(last=False)  # the least recently freed registered block
        del self.cached[self.block_keys[b]]
        self.block_keys[b] = None
        self.num_evictions += 1
        return b

    def grow(self, seq: Sequence, num_positions: int) -> None:
        """Append blocks to seq's table until positions [0, num_positions) fit (callers check can_grow)."""
        need = self.blocks_to_grow(seq, num_positions)
        if need == 0:
            return
        if need > self.num_free:
            raise RuntimeError(
                f"{seq.request_id}: needs {need} blocks, {self.num_free} free (scheduler bug: "
                "it must check can_grow first)"
            )
        self.register(seq)
        for _ in range(need):
            b = self._take_one()
            self.ref_counts[b] = 1
            seq.block_table.append(b)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Its computed full blocks are registered first; blocks nobody references
        go to the evictable pool (registered) or the free list. The last block is freed first, so it is
        evicted before the blocks in front of it (vLLM's order: a prefix is shared more often than a tail)."""
        self.register(seq)
        counts, keys = self.ref_counts, self.block_keys
        for b in reversed(seq.block_table):
            counts[b] -= 1
            if counts[b] == 0:
                if keys[b] is None:
                    self.free_ids.append(b)
                else:
                    self.evictable[b] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Forget every evictable block (they join the free list); blocks in use stay registered. Returns how
        many were dropped."""
        n = len(self.evictable)
        for b in self.evictable:
            del self.cached[self.block_keys[b]]
            self.block_keys[b] = None
            self.free_ids.append(b)
        self.evictable.clear()
        return n

    def check(self, live: list[Sequence] = ()) -> None:
        """Raise if the accounting is off: counts must equal the references held by `live` sequences, and
        every block must be free, evictable or referenced, the key map agreeing with the blocks' keys."""
        refs = [0] * self.num_blocks
        for s in live:
            for b in s.block_table:
                refs[b] += 1
        if refs != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if refs[b] != self.ref_counts[b]][:5]
            raise AssertionError(f"block reference counts disagree with the live sequences at blocks {bad}")
        free = set(self.free_ids)
        if len(free) != len(self.free_ids) or any(self.ref_counts[b] or self.block_keys[b] for b in free):
            raise AssertionError("free list holds a duplicate, a referenced or a registered block")
        if any(self.ref_counts[b] or self.block_keys[b] is None for b in self.evictable):
            raise AssertionError("evictable pool holds a referenced or an unregistered block")
        if free & set(self.evictable) or 0 in free or 0 in self.evictable:
            raise AssertionError("a block is both free and evictable, or the reserved block is in a pool")
        in_use = sum(1 for c in self.ref_counts[RESERVED_BLOCKS:] if c)
        if len(free) + len(self.evictable) + in_use != self.num_usable:
            raise AssertionError("a block is neither free, evictable nor referenced (leaked)")
        registered = {b: k for b, k in enumerate(self.block_keys) if k is not None}
        if len(registered) != len(self.cached) or any(registered.get(b) != k for k, b in self.cached.items()):
            raise AssertionError("the key map and the blocks' keys disagree")
        if not self.enable_prefix_caching and self.cached:
            raise AssertionError("prefix caching is off but blocks are registered")
