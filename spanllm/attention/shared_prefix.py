"""Shared-prefix decode attention: the plan of which decodes share a cached prefix and read it once.

With prefix caching, sequences that start with the same tokens hold the same physical KV blocks (a system
prompt, few-shot examples, an earlier turn). A decode step that attends each sequence over its whole context
reads those blocks once per sequence; 256 decodes over a 2,048-token shared prompt read 256 x 2,048 keys where
2,048 would do. The Triton backend splits such a step in two (the same log-sum-exp merge as FlashInfer's
cascade attention):

    stage 1  per group of decodes sharing a prefix of P keys: all members' queries (members x the g query
             heads of a KV head, as rows of one tensor-core tile) against the P prefix keys, read once;
             partial (m, l, acc) per member, query head and key split
    stage 2  the decode kernel over each sequence's own keys [P, n), folding its group's partials into
             the result before it stores

This module is the host side: `plan_shared_prefix` finds the groups from the step's block tables (host
arrays), with no help from the scheduler: equal leading block ids are equal keys (a block's id is its
content's only home while referenced). Rows are sorted lexicographically by their block-table bytes, so rows
with a common prefix of blocks are adjacent (the rows starting with a given byte string form an interval of
any lexicographic order); adjacent rows' common prefix is then one vectorized comparison, and groups are
maximal runs of adjacent rows sharing at least `min_keys` keys, cut at `members` rows. A group's prefix is
the minimum over its adjacent pairs, and at most every member's context minus one key rounded down to a
block: every member keeps at least its newest key for stage 2, so no row's stage 2 is empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spanllm.kernels.shared_prefix_layout import MAX_PREFIX_SPLITS

# --shared-prefix-attention: auto (on with the Triton backend, the only one that has it), on, off
SHARED_PREFIX_ATTENTION = ("auto", "on", "off")
# A group must share at least this many keys: below it the second kernel's launch and the partials' round trip
# cost about what the saved reads do.
DEFAULT_MIN_SHARED_KEYS = 512
MIN_TILES_PER_SPLIT = 2  # a stage-1 split takes at least this many key tiles
GROUP_ROWS = 64  # stage 1's query rows per program: members x g (padded to a power of two)
SORT_BLOCKS = 256  # the planner sorts rows by their first 256 block ids (4,096 keys at block size 16)


def members_per_group(group: int) -> int:
    """Members of one stage-1 program: GROUP_ROWS query rows over g query heads each (g padded to a power of 2)."""
    g_pad = 1 << max(0, (group - 1).bit_length())
    return max(1, GROUP_ROWS // g_pad)


def max_units(batch: int, target_units: int) -> int:
    """Stage-1 programs per KV head a step of `batch` decodes may need: every group takes one or more units, a
    group has at least two members, and splitting stops at target_units. The size of a graph's unit buffer."""
    return max(1, batch // 2, target_units)


@dataclass
class SharedPrefixPlan:
    """Host arrays (int32) for one decode step's B rows; empty groups: nothing shared."""

    group_rows: np.ndarray  # [num_groups, members]: the group's decode rows, -1 past its last member
    units: np.ndarray  # [num_units, 5]: (group, split, first key tile, end key tile, prefix keys) of stage 1
    row_prefix: np.ndarray  # [B]: keys [0, row_prefix) are the group's shared prefix (0: not in a group)
    row_splits: np.ndarray  # [B]: stage-1 partials the row folds in (its group's splits; 0: none)

    @property
    def num_groups(self) -> int:
        return int(self.group_rows.shape[0])

    @property
    def shared_rows(self) -> int:
        return int((self.row_prefix > 0).sum())

    def keys_saved(self) -> int:
        """Per KV head: prefix keys a plain decode would read that this plan does not ((members - 1) x P)."""
        return int(self.row_prefix.sum() - sum(int(u[4]) for u in self.units if u[1] == 0))


def _common_blocks(tables: np.ndarray, order: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Leading equal block ids of each adjacent pair of rows in `order`, capped by limit (per row)."""
    a, b = tables[order[:-1]], tables[order[1:]]
    eq = a == b
    first_diff = np.where(eq.all(axis=1), tables.shape[1], eq.argmin(axis=1))
    return np.minimum(first_diff, np.minimum(limit[order[:-1]], limit[order[1:]]))


def plan_shared_prefix(
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    block_size: int,
    key_tile: int,
    *,
    min_keys: int = DEFAULT_MIN_SHARED_KEYS,
    members: int = 16,
    target_units: int = 32,
    max_splits: int = MAX_PREFIX_SPLITS,
) -> SharedPrefixPlan:
    """The groups of one decode step. block_tables [B, W] (only the first ceil(n / block_size) ids of a row
    matter), context_lens [B] (keys, the newest included); key_tile: stage 1's keys per tile; min_keys: the
    least prefix a group shares; members: the most rows of one group (stage 1's tile); target_units: stage-1
    programs per KV head to aim for (splits of long prefixes fill the GPU when groups are few); max_splits: the
    most stage-1 splits of one group (1 ... MAX_PREFIX_SPLITS: the kernels' partial buffers hold that many)."""
    if not 1 <= max_splits <= MAX_PREFIX_SPLITS:
        raise ValueError(f"max_splits={max_splits} must be in [1, {MAX_PREFIX_SPLITS}] (the partial buffers' splits)")
    if members < 1 or members & (members - 1):
        raise ValueError(f"members={members} must be a power of two (stage 1's rows are members x a power of two)")
    b = len(context_lens)
    ctx = np.asarray(context_lens, dtype=np.int64)
    row_prefix = np.zeros(b, np.int32)
    row_splits = np.zeros(b, np.int32)
    empty = SharedPrefixPlan(np.zeros((0, members), np.int32), np.zeros((0, 5), np.int32), row_prefix, row_splits)
    if b < 2 or members < 2:
        return empty
    min_blocks = max(1, -(-min_keys // block_size))
    limit = np.maximum(ctx - 1, 0) // block_size  # whole blocks before each row's newest key
    cand = np.flatnonzero(limit >= min_blocks)
    if len(cand) < 2:
        return empty
    width = int(min(block_tables.shape[1], limit[cand].max()))
    tables = np.ascontiguousarray(block_tables[:, :width], dtype=np.int32)
    # Sort by at most the first SORT_BLOCKS ids (memcmp of long rows is the cost): rows that agree that far are
    # adjacent whatever follows, and their runs' common prefix is measured over the whole width below.
    k = min(width, SORT_BLOCKS)
    keys = np.ascontiguousarray(tables[cand, :k]).view(np.dtype((np.void, 4 * k))).ravel()
    order = cand[np.argsort(keys, kind="stable")]
    common = _common_blocks(tables, order, limit)  # [n - 1]: order[i] with order[i + 1]
    # Runs of adjacent rows sharing >= min_blocks, cut every `members` rows; a chunk's prefix is the least of its
    # adjacent pairs' (a chunk's first position counts no pair). A weak link, a pair sharing less than half of what
    # a neighbouring pair shares (a row that shares only part of a family's prefix sorts to the family's edge), also
    # cuts: the row is left out rather than shrinking the whole family's prefix to its own.
    n = len(order)
    left = np.concatenate([[0], common[:-1]])
    right = np.concatenate([common[1:], [0]])
    weak = (common < min_blocks) | (2 * common < np.maximum(left, right))
    seg_start = np.concatenate([[True], weak])
    seg_first = np.flatnonzero(seg_start)
    pos = np.arange(n) - seg_first[np.cumsum(seg_start) - 1]
    chunk_start = seg_start | (pos % members == 0)
    chunk_first = np.flatnonzero(chunk_start)
    chunk_of = np.cumsum(chunk_start) - 1
    sizes = np.diff(np.append(chunk_first, n))
    pair = np.empty(n, np.int64)
    pair[0] = width
    pair[1:] = common
    pair[chunk_start] = width
    chunk_blocks = np.minimum.reduceat(pair, chunk_first)
    kept = np.flatnonzero(sizes >= 2)
    if len(kept) == 0:
        return empty
    group_of_chunk = np.full(len(chunk_first), -1, np.int64)
    group_of_chunk[kept] = np.arange(len(kept))
    gid = group_of_chunk[chunk_of]  # per position; -1: not in a group
    mine = gid >= 0
    group_rows = np.full((len(kept), members), -1, np.int32)
    group_rows[gid[mine], (np.arange(n) - chunk_first[chunk_of])[mine]] = order[mine]
    # Stage-1 units: a long prefix split over several programs while groups are fewer than target_units.
    prefix = (chunk_blocks[kept] * block_size).astype(np.int64)
    n_tiles = -(-prefix // key_tile)
    per_group = max(1, target_units // len(kept))
    splits = np.clip(np.minimum(per_group, -(-n_tiles // MIN_TILES_PER_SPLIT)), 1, max_splits)
    per_split = -(-n_tiles // splits)
    splits = -(-n_tiles // per_split)  # every split owns at least one tile
    g = np.repeat(np.arange(len(kept)), splits)
    s = np.arange(len(g)) - np.repeat(np.cumsum(splits) - splits, splits)
    t0 = s * per_split[g]
    units = np.stack([g, s, t0, np.minimum(n_tiles[g], t0 + per_split[g]), prefix[g]], axis=1).astype(np.int32)
    row_prefix[order[mine]] = prefix[gid[mine]]
    row_splits[order[mine]] = splits[gid[mine]]
    return SharedPrefixPlan(group_rows, units, row_prefix, row_splits)
