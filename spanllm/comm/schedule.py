"""All-reduce schedules as data.

A schedule says, for one rank, what happens in each round: which element ranges go to which
peer, which ranges come back from which peer and whether they are added into the local buffer
(`reduce`) or overwrite it (`copy`). Pure functions build them; nothing here touches a process
group, so the schedules are tested without processes (`simulate`) and executed by
`spanllm.comm.reference` over torch.distributed point-to-point.

Within a round every send reads the buffer as it was at the start of the round, then all receives
are applied in list order. Ranges are half-open element ranges [start, stop).

Algorithms:
  ring                 reduce-scatter around the ring, then all-gather: 2(P-1) rounds.
  recursive doubling   log2(P) rounds exchanging the whole buffer with rank XOR 2^k. A non-power-of-two
                       world folds: rank p2+i (an "extra" rank) first sends everything to rank i, sits
                       out, and receives the result in a last round.
  hierarchical         NVRAR's structure: intra-node reduce-scatter (direct: shard j goes to local
                       rank j), inter-node recursive doubling of the shard between ranks with the same
                       local rank (folding non-power-of-two node counts), intra-node all-gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from spanllm.comm.topology import Topology

Op = Literal["reduce", "copy"]


@dataclass(frozen=True)
class Send:
    peer: int
    start: int
    stop: int


@dataclass(frozen=True)
class Recv:
    peer: int
    start: int
    stop: int
    op: Op


@dataclass(frozen=True)
class Round:
    sends: tuple[Send, ...] = ()
    recvs: tuple[Recv, ...] = ()
    phase: str = field(default="", compare=False)  # for errors: which step of the algorithm this round is


@dataclass(frozen=True)
class Schedule:
    algorithm: str
    rank: int
    world_size: int
    length: int
    rounds: tuple[Round, ...] = field(default=())

    @property
    def num_messages(self) -> int:
        return sum(len(r.sends) for r in self.rounds)

    @property
    def elements_sent(self) -> int:
        return sum(s.stop - s.start for r in self.rounds for s in r.sends)


def partition(length: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, length) into `parts` contiguous ranges whose sizes differ by at most one (first ones larger)."""
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    base, extra = divmod(length, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _nonempty(items):
    return tuple(i for i in items if i.stop > i.start)


# --------------------------------------------------------------------------------------------------
# ring


def ring_schedule(rank: int, world_size: int, length: int) -> Schedule:
    """Ring reduce-scatter (P-1 rounds) then ring all-gather (P-1 rounds).

    In reduce-scatter round k, rank r sends chunk (r - k) mod P to r+1 and adds chunk (r - k - 1) mod P
    from r-1; after P-1 rounds rank r owns the full sum of chunk (r + 1) mod P, which the all-gather
    rounds pass around the ring.
    """
    P = world_size
    chunks = partition(length, P)
    nxt, prv = (rank + 1) % P, (rank - 1) % P
    rounds = []
    for phase in ("reduce", "copy"):
        for k in range(P - 1):
            shift = k if phase == "reduce" else k - 1
            s = chunks[(rank - shift) % P]
            r = chunks[(rank - shift - 1) % P]
            name = "reduce-scatter" if phase == "reduce" else "all-gather"
            rounds.append(Round(_nonempty([Send(nxt, *s)]), _nonempty([Recv(prv, *r, phase)]), name))
    return Schedule("ring", rank, P, length, tuple(rounds))


# --------------------------------------------------------------------------------------------------
# recursive doubling over an arbitrary list of members (used directly and for the inter-node leg)


def _recursive_doubling_rounds(members: list[int], me: int, start: int, stop: int) -> list[Round]:
    """Rounds that all-reduce [start, stop) among `members` (global ranks); `me` is one of them."""
    rounds = _recursive_doubling_steps(members, me, start, stop)
    n = len(members)
    p2 = 1 << (n.bit_length() - 1)
    names = [f"exchange {k + 1} of {p2.bit_length() - 1}" for k in range(p2.bit_length() - 1)]
    if n > p2:
        names = ["fold"] + names + ["unfold"]
    return [Round(r.sends, r.recvs, f"recursive doubling {name}") for r, name in zip(rounds, names, strict=True)]


def _recursive_doubling_steps(members: list[int], me: int, start: int, stop: int) -> list[Round]:
    n = len(members)
    if n == 1:
        return []
    if stop <= start:  # an empty shard: keep the round count equal on every rank, move nothing
        p2 = 1 << (n.bit_length() - 1)
        return [Round() for _ in range(p2.bit_length() - 1 + (2 if n > p2 else 0))]
    idx = members.index(me)
    p2 = 1 << (n.bit_length() - 1)  # largest power of two <= n
    rounds: list[Round] = []
    fold = n > p2
    if fold:
        # Fold: the extra member p2+i hands its data to member i, which reduces it.
        if idx >= p2:
            rounds.append(Round((Send(members[idx - p2], start, stop),), ()))
        elif idx < n - p2:
            rounds.append(Round((), (Recv(members[idx + p2], start, stop, "reduce"),)))
        else:
            rounds.append(Round())
    for k in range(p2.bit_length() - 1):
        if idx < p2:
            partner = members[idx ^ (1 << k)]
            rounds.append(Round((Send(partner, start, stop),), (Recv(partner, start, stop, "reduce"),)))
        else:
            rounds.append(Round())
    if fold:
        # Unfold: member i returns the finished sum to the extra member p2+i.
        if idx >= p2:
            rounds.append(Round((), (Recv(members[idx - p2], start, stop, "copy"),)))
        elif idx < n - p2:
            rounds.append(Round((Send(members[idx + p2], start, stop),), ()))
        else:
            rounds.append(Round())
    return rounds


def recursive_doubling_schedule(rank: int, world_size: int, length: int) -> Schedule:
    rounds = _recursive_doubling_rounds(list(range(world_size)), rank, 0, length)
    return Schedule("recursive_doubling", rank, world_size, length, tuple(rounds))


# --------------------------------------------------------------------------------------------------
# hierarchical (NVRAR)


def hierarchical_schedule(rank: int, topology: Topology, length: int) -> Schedule:
    """Intra-node reduce-scatter -> inter-node recursive doubling on the shard -> intra-node all-gather."""
    g = topology.ranks_per_node
    node, local = topology.node_of(rank), topology.local_rank(rank)
    peers = topology.node_ranks(node)
    shards = partition(length, g)
    rounds: list[Round] = []
    if g > 1:
        # Direct reduce-scatter: every rank sends shard j to local rank j and adds the others' copies
        # of its own shard, in local-rank order (a fixed order keeps the result deterministic).
        sends = _nonempty(Send(peers[j], *shards[j]) for j in range(g) if j != local)
        recvs = _nonempty(Recv(peers[j], *shards[local], "reduce") for j in range(g) if j != local)
        rounds.append(Round(sends, recvs, "intra-node reduce-scatter"))
    inter = _recursive_doubling_rounds(topology.rail_ranks(local), rank, *shards[local])
    rounds += [Round(r.sends, r.recvs, f"inter-node {r.phase}") for r in inter]
    if g > 1:
        sends = _nonempty(Send(peers[j], *shards[local]) for j in range(g) if j != local)
        recvs = _nonempty(Recv(peers[j], *shards[j], "copy") for j in range(g) if j != local)
        rounds.append(Round(sends, recvs, "intra-node all-gather"))
    return Schedule("hierarchical", rank, topology.world_size, length, tuple(rounds))


SCHEDULES: dict[str, Callable[[int, Topology, int], Schedule]] = {
    "ring": lambda rank, topo, n: ring_schedule(rank, topo.world_size, n),
    "recursive_doubling": lambda rank, topo, n: recursive_doubling_schedule(rank, topo.world_size, n),
    "hierarchical": hierarchical_schedule,
}


# --------------------------------------------------------------------------------------------------
# symbolic check


class ScheduleError(AssertionError):
    pass


def simulate(schedules: list[Schedule]) -> np.ndarray:
    """Run every rank's schedule on symbolic buffers and return the contribution counts.

    Rank r's buffer starts as the one-hot vector of r at every element; `reduce` adds count vectors,
    `copy` replaces them. The result has shape [world, length, world]: out[r, i, q] is how many times
    rank q's input reached element i of rank r. A correct all-reduce gives all ones. Raises
    ScheduleError when sends and receives of a round do not match (peer, range).
    """
    P = len(schedules)
    n = schedules[0].length
    nrounds = {len(s.rounds) for s in schedules}
    if len(nrounds) != 1:
        raise ScheduleError(f"ranks disagree on the number of rounds: {sorted(nrounds)}")
    state = np.zeros((P, n, P), dtype=np.int64)
    for r in range(P):
        state[r, :, r] = 1
    for k in range(nrounds.pop()):
        before = state.copy()
        # Match every receive with the corresponding send.
        pending: dict[tuple[int, int, int, int], int] = {}
        for r, s in enumerate(schedules):
            for snd in s.rounds[k].sends:
                key = (r, snd.peer, snd.start, snd.stop)
                pending[key] = pending.get(key, 0) + 1
        for r, s in enumerate(schedules):
            for rcv in s.rounds[k].recvs:
                key = (rcv.peer, r, rcv.start, rcv.stop)
                if pending.get(key, 0) == 0:
                    raise ScheduleError(
                        f"round {k}: rank {r} expects [{rcv.start}, {rcv.stop}) from "
                        f"{rcv.peer}, which sends no such range"
                    )
                pending[key] -= 1
                data = before[rcv.peer, rcv.start : rcv.stop]
                if rcv.op == "reduce":
                    state[r, rcv.start : rcv.stop] += data
                else:
                    state[r, rcv.start : rcv.stop] = data
        leftover = [k_ for k_, v in pending.items() if v]
        if leftover:
            raise ScheduleError(f"round {k}: sends nobody receives: {leftover[:4]}")
    return state
