"""Large messages go to the group's collective: one communicator made of two.

A buffered backend (nvrar, torch symmetric memory) takes messages up to its buffer; prefill activations
are larger. `SizeFallback(primary, fallback)` sends each call to `primary` when primary's declared
capability takes it (`primary.unsupported_reason(x) is None`: size, dtype, device) and to `fallback`
otherwise, so a caller holds one communicator and one call site. `algorithm_for(x)` names what runs, so
the fallback is never silent. `with_group_fallback(comm)` adds the process group's own collective
(nccl / gloo) behind a backend that has a buffer, and returns an unbuffered one as it is.

Both halves must be built on the same group in the same order on every rank (construction is
collective), and every rank sends the same message to the same half: the rule depends only on the
tensor's size, dtype and device, which all ranks share.
"""

from __future__ import annotations

import torch

from spanllm.comm import registry
from spanllm.comm.base import AllReduce
from spanllm.comm.torch_dist import default_backend, device_type_of


class SizeFallback:
    """`primary` for what it can take, `fallback` for the rest (typically: messages above primary's buffer).

    Owns both: `close()` closes them (collective, like their construction)."""

    def __init__(self, primary: AllReduce, fallback: AllReduce) -> None:
        # primary may be any communicator object with all_reduce_, max_bytes and unsupported_reason (the
        # engine accepts such objects); what it lacks of an AllReduce is taken from the fallback.
        pw, fw = getattr(primary, "world_size", fallback.world_size), fallback.world_size
        if pw != fw:
            raise ValueError(
                f"SizeFallback: primary {primary.name} spans {pw} ranks but fallback "
                f"{fallback.name} spans {fw}; build both on the same process group"
            )
        self.primary, self.fallback = primary, fallback
        self.name = getattr(primary, "name", type(primary).__name__)  # what was asked for; algorithm_for(x): what runs
        self.group, self.rank, self.world_size = fallback.group, fallback.rank, fw
        self.topology = getattr(primary, "topology", fallback.topology)

    @property
    def max_bytes(self) -> int | None:
        return self.fallback.max_bytes

    def comm_for(self, x: torch.Tensor) -> AllReduce:
        """The half that reduces x."""
        return self.primary if self.primary.unsupported_reason(x) is None else self.fallback

    def unsupported_reason(self, x: torch.Tensor) -> str | None:
        return None if self.primary.unsupported_reason(x) is None else self.fallback.unsupported_reason(x)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place, with comm_for(x); returns x."""
        return self.comm_for(x).all_reduce_(x)

    __call__ = all_reduce_

    def algorithm_for(self, x: torch.Tensor) -> str:
        half = self.comm_for(x)
        probe = getattr(half, "algorithm_for", None)
        return probe(x) if probe is not None else getattr(half, "name", type(half).__name__)

    def close(self) -> None:
        self.primary.close()
        self.fallback.close()

    def __enter__(self) -> SizeFallback:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SizeFallback(primary={self.primary!r}, fallback={self.fallback!r})"


def with_group_fallback(comm: AllReduce, **options) -> AllReduce | SizeFallback:
    """comm itself when it has no buffer limit (nccl, gloo, the CPU reference); else SizeFallback(comm, the
    group's own collective on comm's group and topology). Collective when it builds the fallback.
    `options` go to registry.create (e.g. check_sizes)."""
    if comm.max_bytes is None:
        return comm
    fallback = registry.create(
        default_backend(device_type_of(comm.group)), group=comm.group, topology=comm.topology, **options
    )
    return SizeFallback(comm, fallback)
