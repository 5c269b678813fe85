"""`auto`: per call, the algorithm `spanllm.comm.selection.select` picks, among backends built up front.

Construction is collective (it builds every candidate in a fixed order). `algorithm_for(x)` and
`last_choice` say what ran and why.
"""

from __future__ import annotations

import torch

from spanllm.comm import registry
from spanllm.comm.base import AllReduce, AllReduceInputError, Capability
from spanllm.comm.selection import Candidate, Choice, select
from spanllm.comm.torch_dist import default_backend, device_type_of
from spanllm.comm.tuning import TuningTable

CANDIDATES = {
    "cuda": (default_backend("cuda"), "nvrar", "torch_one_shot", "torch_two_shot"),
    "cpu": (default_backend("cpu"), "ref_hier"),
}


class AutoAllReduce(AllReduce):
    name = "auto"
    refusal_fix = " (no candidate of auto takes it: pass a supported dtype on a supported device)"
    capability = Capability(
        dtypes=frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}),
        device_types=frozenset({"cpu", "cuda"}),
    )

    def __init__(
        self,
        group=None,
        topology=None,
        *,
        tuning: TuningTable | None = None,
        device: torch.device | None = None,
        candidates: tuple[str, ...] | None = None,
        **options,
    ) -> None:
        super().__init__(group, topology)
        device_type = device.type if device is not None else device_type_of(self.group)
        self.device_type = device_type
        if tuning is not None and not any(e.topology == str(self.topology) for e in tuning.entries):
            # A table measured elsewhere would never match a call: refuse it rather than fall back silently.
            have = sorted({e.topology for e in tuning.entries})
            raise AllReduceInputError(
                f"auto: the tuning table has no entry for this topology {self.topology} (it covers "
                f"{', '.join(have) if have else 'nothing: it has no entries'}); run `spanllm tune` on this "
                "topology and pass that table (tables merge: --tuning A.json,B.json), or pass no table"
            )
        self.table = tuning
        names = candidates or CANDIDATES[device_type]
        self.backends: dict[str, AllReduce] = {}
        for name in names:
            cls = registry.algorithm_class(name)
            if device_type not in cls.capability.device_types:
                continue
            if cls.capability.topology_rule and cls.capability.topology_rule(self.topology):
                continue  # cannot run on this topology at all: not a candidate
            self.backends[name] = registry.create(
                name, group=self.group, topology=self.topology, tuning=tuning, device=device, **options
            )
        self._candidates = [Candidate(n, b.capability, b.max_bytes) for n, b in self.backends.items()]
        # Agree over the group when every candidate does (gloo, the reference), so input that auto itself
        # refuses on one rank, or an empty tensor on one rank only, raises everywhere instead of a hang.
        self.check_sizes = bool(self.backends) and all(b.check_sizes for b in self.backends.values())
        self.last_choice: Choice | None = None

    def choose(self, x: torch.Tensor) -> Choice:
        return select(x.numel() * x.element_size(), x.dtype, self.topology, x.device.type, self._candidates, self.table)

    def algorithm_for(self, x: torch.Tensor) -> str:
        name = self.choose(x).algorithm
        return self.backends[name].algorithm_for(x)

    def _all_reduce_(self, x: torch.Tensor) -> None:
        self.last_choice = self.choose(x)
        self.backends[self.last_choice.algorithm].all_reduce_(x)  # the backend's own checks run too

    def close(self) -> None:
        for b in self.backends.values():
            b.close()
        super().close()
