"""The reference executor: runs any schedule of `spanllm.comm.schedule` over torch.distributed point-to-point.

It is the semantic oracle of the library. It is deliberately plain: per round, post every send and
receive, wait for all of them, then apply the receives (add or overwrite) in the schedule's order.
Fast backends are tested against it with the same inputs and exact expected values.

It runs wherever the process group can send and receive: gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spanllm.comm.base import _DTYPE_CODES, AllReduce, Capability, collective_failure
from spanllm.comm.schedule import SCHEDULES, Schedule


class RefAllReduce(AllReduce):
    """Executes `SCHEDULES[schedule_name]`. `check_sizes` verifies that every rank passed the same
    element count and dtype, and that no rank refused its tensor, before running (one small all-gather,
    `AllReduce.check_call`), so a mismatch is an error on every rank and not a hang or a silent partial sum."""

    schedule_name: str
    capability = Capability(dtypes=frozenset(_DTYPE_CODES), device_types=frozenset({"cpu", "cuda"}))

    def __init__(self, group=None, topology=None, *, check_sizes: bool = True) -> None:
        super().__init__(group, topology)
        self.check_sizes = check_sizes
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        self._schedules: dict[int, Schedule] = {}

    def schedule(self, length: int) -> Schedule:
        if length not in self._schedules:
            self._schedules[length] = SCHEDULES[self.schedule_name](self.rank, self.topology, length)
        return self._schedules[length]

    def _all_reduce_(self, x: torch.Tensor) -> None:
        # Like torch.distributed's collectives, the reduction writes x's data outside autograd: under
        # inference mode, a leaf that requires grad or an inference tensor is reduced like any other
        # instead of raising on some ranks mid-schedule (which would leave the others waiting on a send).
        with torch.inference_mode():
            self._run_schedule(x)

    def _run_schedule(self, x: torch.Tensor) -> None:
        flat = x.view(-1)
        rounds = self.schedule(flat.numel()).rounds
        for k, rnd in enumerate(rounds):
            works, incoming = [], []
            for s in rnd.sends:
                works.append(dist.isend(flat[s.start : s.stop], self._global[s.peer], group=self.group))
            for r in rnd.recvs:
                buf = torch.empty(r.stop - r.start, dtype=x.dtype, device=x.device)
                works.append(dist.irecv(buf, self._global[r.peer], group=self.group))
                incoming.append((r, buf))
            try:
                for w in works:
                    w.wait()
            except RuntimeError as e:  # gloo / NCCL: a peer timed out or went away
                peers = sorted({m.peer for m in rnd.sends + rnd.recvs})
                where = (
                    f"{self.name}: rank {self.rank} failed in round {k + 1} of {len(rounds)} "
                    f"({rnd.phase or self.schedule_name}) exchanging {flat.numel()} elements with ranks {peers}"
                )
                raise collective_failure(e, where) from e
            for r, buf in incoming:
                if r.op == "reduce":
                    flat[r.start : r.stop] += buf
                else:
                    flat[r.start : r.stop] = buf


class RefRingAllReduce(RefAllReduce):
    name = "ref_ring"
    schedule_name = "ring"


class RefRecursiveDoublingAllReduce(RefAllReduce):
    name = "ref_rd"
    schedule_name = "recursive_doubling"


class RefHierarchicalAllReduce(RefAllReduce):
    name = "ref_hier"
    schedule_name = "hierarchical"
