"""The interface every all-reduce backend implements.

An `AllReduce` is created once per process group and topology, holds whatever it needs (buffers,
flags, sequence counters) for its whole life, and is released with `close()`. A call is an
in-place SUM: `comm.all_reduce_(x)` leaves the element-wise sum over the group's ranks in `x`.

Each backend declares what it supports (`Capability`) so that selection can be a pure function
over plain values (`spanllm.comm.selection`) and so that unsupported input fails loudly here,
naming the value, the limit and the fix, instead of hanging inside a kernel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from spanllm.comm.topology import Topology
from spanllm.dtypes import DTYPE_NAMES


class AllReduceError(RuntimeError):
    """A backend failed at run time (a peer timed out, a kernel reported an error)."""


class AllReduceInputError(ValueError):
    """The caller passed a tensor this backend cannot reduce."""


@dataclass(frozen=True)
class Capability:
    """What a backend can reduce. `topology_rule` returns None when a topology is fine, else why not."""

    dtypes: frozenset[torch.dtype]
    device_types: frozenset[str]
    max_bytes: int | None = None  # None: no limit of its own (a buffered backend sets it per instance)
    size_multiple_bytes: int = 1  # message size must be a multiple of this (e.g. 4 for torch's symm-mem ops)
    topology_rule: Callable[[Topology], str | None] | None = field(default=None, compare=False)

    def unsupported_reason(
        self, *, nbytes: int, dtype: torch.dtype, topology: Topology, device_type: str, max_bytes: int | None = None
    ) -> str | None:
        """None if this backend can run the call, else a sentence saying why not."""
        if device_type not in self.device_types:
            return f"runs on {sorted(self.device_types)}, not {device_type}"
        if dtype not in self.dtypes:
            return f"dtype {dtype} not in {sorted(DTYPE_NAMES.get(d, str(d)) for d in self.dtypes)}"
        if nbytes % self.size_multiple_bytes:
            return f"{nbytes} bytes is not a multiple of {self.size_multiple_bytes} bytes"
        limit = max_bytes if max_bytes is not None else self.max_bytes
        if limit is not None and nbytes > limit:
            return f"{nbytes} bytes exceed its buffer of {limit} bytes"
        if self.topology_rule is not None:
            return self.topology_rule(topology)
        return None


def collective_failure(e: RuntimeError, where: str) -> RuntimeError:
    """torch's error `e` (a peer timed out or went away) with `where` (algorithm, rank, phase) in front. Same
    type as `e`, so the launcher still tells a peer's failure from this rank's own (spanllm.launch.error_kind)."""
    msg = f"{where}: {e}; every rank must make the same all-reduce calls in the same order"
    try:
        return type(e)(msg)
    except Exception:  # an error type that cannot be built from a message
        return RuntimeError(msg)


_DTYPE_CODES = {dt: i for i, dt in enumerate(DTYPE_NAMES)}  # dtype -> small integer, for check_same_input


def check_same_input(x: torch.Tensor, group: dist.ProcessGroup, name: str, refused: str | None = None) -> None:
    """Raise AllReduceInputError on every rank unless all ranks of `group` pass the same element count and
    dtype and no rank refused its tensor (`refused`: the message of this rank's own check_input error). One small
    all-gather: a mismatch, or bad input on one rank only, becomes an error on every rank instead of a hang
    (the other ranks waiting in the collective the refusing rank never enters), an abort or a partial sum.
    The refusing rank raises its own error; the others name it."""
    code = _DTYPE_CODES.get(x.dtype, -1)
    mine = torch.tensor([x.numel(), code, 0 if refused is None else 1], dtype=torch.int64, device=x.device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(everyone, mine, group=group)
    except RuntimeError as e:  # a peer timed out or went away
        raise collective_failure(
            e,
            f"{name}: rank {dist.get_rank(group)} failed in the size check before any data moved (all-gather of "
            "element count and dtype)",
        ) from e
    if refused is not None:
        raise AllReduceInputError(refused)
    seen = [tuple(int(v) for v in t.tolist()) for t in everyone]
    names = {v: k for k, v in _DTYPE_CODES.items()}
    desc = ", ".join(f"rank {r}: {n} x {names.get(c, 'unsupported dtype')}" for r, (n, c, _) in enumerate(seen))
    bad = [r for r, (_, _, b) in enumerate(seen) if b]
    if bad:
        raise AllReduceInputError(
            f"{name}: rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} refused its tensor ({desc}); "
            "every rank raises so that none waits for it: fix the input there (its error says why)"
        )
    if len({(n, c) for n, c, _ in seen}) != 1:
        raise AllReduceInputError(
            f"{name}: ranks passed different tensors ({desc}); every rank must pass the same element count and dtype"
        )


class AllReduce(ABC):
    """In-place SUM all-reduce over one process group.

    Subclasses set `name` and `capability` and implement `_all_reduce_`. The constructor is
    collective over the group for backends that allocate shared buffers: every rank of the group
    must create its communicators in the same order.
    """

    name: ClassVar[str]
    capability: ClassVar[Capability]
    # With check_sizes, every call first agrees over the group (check_same_input): one small all-gather.
    check_sizes: bool = False
    # How to get past a refused input (auto overrides it: it cannot point at itself).
    refusal_fix: ClassVar[str] = " (use algorithm 'auto', which falls back to one that fits, or a supported input)"

    def __init__(self, group: dist.ProcessGroup | None = None, topology: Topology | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.topology = topology if topology is not None else Topology.from_env(self.world_size)
        if self.topology.world_size != self.world_size:
            raise AllReduceInputError(
                f"topology {self.topology} describes {self.topology.world_size} ranks but the process group "
                f"has {self.world_size}; build Topology(world_size={self.world_size}, ranks_per_node=...)"
            )
        reason = self.capability.topology_rule(self.topology) if self.capability.topology_rule else None
        if reason is not None:
            raise AllReduceInputError(f"{self.name} cannot run on topology {self.topology}: {reason}")
        self.closed = False

    # The limit of this instance (buffered backends override with their allocation).
    @property
    def max_bytes(self) -> int | None:
        return self.capability.max_bytes

    def unsupported_reason(self, x: torch.Tensor) -> str | None:
        return self.capability.unsupported_reason(
            nbytes=x.numel() * x.element_size(),
            dtype=x.dtype,
            topology=self.topology,
            device_type=x.device.type,
            max_bytes=self.max_bytes,
        )

    def check_input(self, x: torch.Tensor) -> None:
        if self.closed:
            raise AllReduceError(f"{self.name}: communicator was closed; create a new one")
        if not isinstance(x, torch.Tensor):
            raise AllReduceInputError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_contiguous():
            raise AllReduceInputError(
                f"{self.name}: tensor with shape {tuple(x.shape)} and stride {x.stride()} is not contiguous; "
                "pass x.contiguous() (the reduction is in place, so copy back afterwards)"
            )
        reason = self.unsupported_reason(x)
        if reason is not None:
            raise AllReduceInputError(f"{self.name} cannot reduce this tensor: {reason}{self.refusal_fix}")

    def check_call(self, x: torch.Tensor) -> None:
        """check_input on this rank; with `check_sizes`, also on every rank together (check_same_input), so
        input refused on one rank, or a different size or dtype, raises on all of them (also for empty
        tensors) instead of leaving the others waiting in a collective."""
        if not self.check_sizes or self.closed or not isinstance(x, torch.Tensor):
            self.check_input(x)  # no agreement asked for, or a local programming error
            return
        # Only the message is kept: a stored exception forms a frame <-> traceback cycle that holds this
        # communicator, and with it the process group, past destroy_process_group (gloo then aborted a rank
        # at exit now and then: "terminate called without an active exception").
        refused = None
        try:
            self.check_input(x)
        except AllReduceInputError as e:
            refused = str(e)
        check_same_input(x, self.group, self.name, refused)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns `x`."""
        self.check_call(x)
        if x.numel() == 0:
            return x
        self._all_reduce_(x)
        return x

    __call__ = all_reduce_

    def algorithm_for(self, x: torch.Tensor) -> str:
        """The name of the algorithm that runs for this tensor (`auto` names its choice)."""
        return self.name

    @abstractmethod
    def _all_reduce_(self, x: torch.Tensor) -> None: ...

    def close(self) -> None:
        """Release buffers. Collective for backends with shared buffers."""
        self.closed = True

    def __enter__(self) -> AllReduce:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, topology={self.topology})"
